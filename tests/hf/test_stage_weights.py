"""``iter_stage_hf_weights`` (the weight sync's per-stage export) against mbridge's full export.

One 2-rank spawn visits DP2 (TP1), TP2 and PP2 and, for every tiny model variant of ``conftest.py`` (Qwen2
with tied embeddings at PP2: the last stage's output-layer copy is skipped; Llama with vocab 255 at TP2: the
padding row is dropped), collects on each rank ``iter_hf_weights`` (mbridge's ``export_weights``, the
reference) and ``iter_stage_hf_weights``. The parent checks that the TP-rank-0 ranks' stage streams,
concatenated in stage order, are the reference stream (names, order, dtypes, values bitwise; the tied
duplicate dropped) and that TP ranks > 0 yield nothing.

Two more spawns measure the sender's peak memory of the TP gather itself (``ru_maxrss``, 64 MiB tensor): one
copy of the full tensor, not the 2x of gloo's own gather / all-gather staging. The end-to-end sender memory
of a sync is measured by ``bench/bench_weight_sync.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.multirank import run_ranks

LAYOUTS = {"tp1dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def _stage_child(rank: int, world_size: int, model_dirs: dict[str, str]) -> dict:
    from megatron.core import parallel_state

    from megatron_rl.config import MegatronRLConfig, ModelConfig, ParallelConfig
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.hf.weights import iter_hf_weights, iter_stage_hf_weights, policy_from_hf

    out = {}
    for layout, (tp, pp) in LAYOUTS.items():
        parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        groups = initialize_distributed(parallel, seed=7)
        for variant, path in model_dirs.items():
            config = MegatronRLConfig(parallel=parallel, model=ModelConfig(attention_backend="local"))
            policy = policy_from_hf(config, groups, role="reference", hf_dir=path)
            reference = list(iter_hf_weights([policy.module], path, groups))
            stage = [(name, tensor.detach().to("cpu", copy=True))
                     for name, tensor in iter_stage_hf_weights([policy.module], path, groups)]
            out[(layout, variant)] = {"tp_rank": groups.tp_rank, "pp_rank": groups.pp_rank,
                                      "reference": reference, "stage": stage}
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def stage_run(hf_models):
    dirs = {name: str(path) for name, path in hf_models.items()}
    return run_ranks(2, _stage_child, dirs, timeout=600)


def _without_duplicates(items: list) -> list:
    """mbridge exports a tied embedding from both pipeline ends; the stage stream only from the first."""
    seen, kept = set(), []
    for name, tensor in items:
        if name not in seen:
            seen.add(name)
            kept.append((name, tensor))
    return kept


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stage_stream_is_mbridge_export(stage_run, hf_models, layout):
    tp, pp = LAYOUTS[layout]
    for variant in hf_models:
        results = [per_rank[(layout, variant)] for per_rank in stage_run]
        reference = results[0]["reference"]
        for r in results[1:]:  # the full export is the same on every rank
            assert [n for n, _ in r["reference"]] == [n for n, _ in reference], (layout, variant)
        senders = sorted((r for r in results if r["tp_rank"] == 0), key=lambda r: r["pp_rank"])
        for r in results:
            if r["tp_rank"] != 0:
                assert r["stage"] == [], (layout, variant, "a TP helper yielded")
        # PP1 with DP2: both ranks are senders of the one stage; each must stream the whole model.
        streams = [senders] if pp > 1 else [[s] for s in senders]
        for group in streams:
            got = [item for r in group for item in r["stage"]]
            want = _without_duplicates(reference)
            assert [n for n, _ in got] == [n for n, _ in want], (layout, variant)
            for (name, ours), (_, theirs) in zip(got, want):
                assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (layout, variant, name)
                assert torch.equal(ours, theirs), (layout, variant, name)
        if variant == "qwen2_tied" and pp > 1:
            assert len(reference) == len(want) + 1  # the last stage's copy was there and is skipped
        if variant == "llama_v255":
            shapes = dict(want)
            assert shapes["model.embed_tokens.weight"].shape[0] == 255
            assert shapes["lm_head.weight"].shape[0] == 255


# ---------------------------------------------------------------------- memory of the TP gather

MEM_ROWS, MEM_COLS = 4096, 2048  # each rank's shard: 32 MiB fp32; the full tensor 64 MiB


def _memory_child(rank: int, world_size: int, pieces: int) -> dict:
    """One gather per process: ``ru_maxrss`` is a lifetime peak, so a second one in the same process would
    hide under the first one's."""
    import resource
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_rl.hf.weights import _gather_on_first, _send_to_first

    dist.init_process_group("gloo")
    groups = SimpleNamespace(tp_size=world_size, tp_rank=rank, tp_group=dist.group.WORLD)
    shard = torch.full((MEM_ROWS, MEM_COLS), float(rank))
    out = {}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if rank == 0:
        gathered = _gather_on_first(shard, groups, pieces)
        full = gathered.view(-1, MEM_COLS)  # the merged tensor (rows / gated plans)
        out = {"extra_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before,
               "full_kib": full.numel() * full.element_size() // 1024,
               "blocks": full[:: MEM_ROWS // pieces, 0].tolist()}
    else:
        _send_to_first(shard, groups, pieces)
    dist.barrier()
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("pieces", [1, 2], ids=["rows", "gated"])
def test_tp_gather_holds_one_copy(pieces):
    result = run_ranks(2, _memory_child, pieces, timeout=120)[0]
    # rank 0's shard then rank 1's; gated: gate_0, gate_1, up_0, up_1
    assert result["blocks"] == [0.0, 1.0] * pieces, result["blocks"]
    # gloo's own gather would stage a second full copy (measured 2x); allow 25 % for allocator noise
    assert result["extra_kib"] <= 1.25 * result["full_kib"], result
