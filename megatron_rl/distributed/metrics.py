"""Cross-rank reduction of Metric partials (the collective half of megatron_rl/metrics.py).

Place in the data flow: after the pipeline schedule, the last PP stage of every DP replica holds the metric
partials of its micro-batches (merged with ``merge_metrics``); ``reduce_metrics`` combines them over the DP
group and broadcasts the result from the last PP stage, so every rank returns the same ``dict[str, Metric]``.

Partials are combined exactly (sums of values and counts, max/min), so the result equals the metrics of the
whole mini-batch computed at once. The dicts are tiny, so they travel as pickled objects: ranks may hold
different metric names (a name missing on a rank is combined over the others).
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_rl.metrics import Metric, merge_metrics


def reduce_metrics(
    metrics: dict[str, Metric],
    dp_group: dist.ProcessGroup,
    pp_group: dist.ProcessGroup | None = None,
) -> dict[str, Metric]:
    """Combine ``metrics`` over ``dp_group``, then take the last PP stage's result on every stage.

    Ranks of the same DP group sit at the same PP stage, so non-last stages gather empty dicts and then
    receive the last stage's result over ``pp_group``.
    """
    parts: list[dict[str, Metric] | None] = [metrics]
    if dist.get_world_size(dp_group) > 1:  # a group of one has nothing to gather (a pickled round trip per call)
        parts = [None] * dist.get_world_size(dp_group)
        dist.all_gather_object(parts, metrics, group=dp_group)
    merged = merge_metrics(*[p for p in parts if p])
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        box = [merged]
        last = dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)
        dist.broadcast_object_list(box, src=last, group=pp_group)
        merged = box[0]
    return merged
