"""Peak host memory of the log-prob/entropy head's forward + backward on CPU (issue 12, item 5).

    .venv/bin/python bench/bench_logprob_head.py [--tokens 2048] [--vocab 151936] [--module megatron_rl.model.logprobs]

One fresh process per measurement: fp32 logits ``[T, V]`` (a leaf), labels, then
``vocab_parallel_logprobs_entropy(..., compute_entropy=True)``, ``sum(lp) + sum(H)``, backward. Reports the
peak resident memory (``ru_maxrss``) minus the resident memory with the logits already allocated, in GiB,
i.e. what the head adds on top of its input (the input gradient ``[T, V]`` is part of it). ``--module``
names the module providing the function, so an older implementation (a copy of a previous revision on
``PYTHONPATH``) can be measured the same way.
"""

from __future__ import annotations

import argparse
import importlib
import json
import resource

import torch

from procmem import status_kib
from workloads import print_report_or_exit


def measure(tokens: int, vocab: int, module: str) -> dict[str, float]:
    head = importlib.import_module(module)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=gen).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    baseline = status_kib("VmRSS")
    lp, ent = head.vocab_parallel_logprobs_entropy(logits, labels, None, True)
    (lp.sum() + ent.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gib = 1024**2
    return {"tokens": tokens, "vocab": vocab, "module": module, "logits_gib": logits.numel() * 4 / 2**30,
            "extra_peak_gib": (peak - baseline) / gib}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--module", default="megatron_rl.model.logprobs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print_report_or_exit(lambda: {"report": json.dumps(measure(args.tokens, args.vocab, args.module))})


if __name__ == "__main__":
    main()
