"""Mini-batch boundaries counted in prompts (docs/DESIGN.md section 6).

Place in the data flow (docs/DESIGN.md section 1): after advantages, before DP padding. One mini-batch = one
optimizer step = exactly ``mini_batch_size`` prompts, however many sequences (samples x turns) each prompt
produced. Prompts are the contiguous runs of equal ``uids``:

    uids        a a a b b c c c c d        (10 sequences, 4 prompts)
    end indices       3   5       9 10
    boundaries, mini_batch_size=2:  (0, 5), (5, 10)

For non-step-wise data with ``n`` samples per prompt this equals fixed slicing by ``mini_batch_size * n``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def compute_prompt_end_indices(uids: Sequence[Hashable]) -> list[int]:
    """Exclusive end index of each contiguous run of equal uids, in order.

    Raises ``ValueError`` if a uid reappears after a different one (its sequences are not contiguous).
    """
    ends: list[int] = []
    seen: set[Hashable] = set()
    for i, uid in enumerate(uids):
        if i > 0 and uid == uids[i - 1]:
            continue
        if uid in seen:
            raise ValueError(
                f"uids[{i}] = {uid!r} reappears after other prompts: the sequences of one prompt must be "
                "contiguous; sort the generator output by prompt."
            )
        seen.add(uid)
        if i > 0:
            ends.append(i)
    if uids:
        ends.append(len(uids))
    return ends


def compute_prompt_mini_batch_boundaries(uids: Sequence[Hashable], mini_batch_size: int) -> list[tuple[int, int]]:
    """``(start, end)`` sequence ranges partitioning ``[0, len(uids))``, each holding ``mini_batch_size`` prompts.

    Raises ``ValueError`` if ``mini_batch_size < 1``, uids are not contiguous, or the number of prompts is not a
    multiple of ``mini_batch_size``.
    """
    if mini_batch_size < 1:
        raise ValueError(f"mini_batch_size={mini_batch_size} must be >= 1 (prompts per optimizer step).")
    ends = compute_prompt_end_indices(uids)
    if len(ends) % mini_batch_size != 0:
        raise ValueError(
            f"uids hold {len(ends)} prompts, not a multiple of mini_batch_size={mini_batch_size}: make "
            "train_batch_size a multiple of policy_mini_batch_size, or generate complete prompt groups."
        )
    mini_batch_ends = ends[mini_batch_size - 1 :: mini_batch_size]
    starts = [0] + mini_batch_ends[:-1]
    return list(zip(starts, mini_batch_ends))
