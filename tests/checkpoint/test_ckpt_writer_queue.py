"""W31 (docs/MEGATRON_CORE.md): a checkpoint save starts no process. megatron-core's writer gets an in-process
results queue (``checkpoint/dist.py: writer_queue_in_process``) instead of the ``multiprocessing.Manager()`` server
it spawns at the first save, which outlived a SIGKILLed rank and cost ~4 CPU s per saving rank of every run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.multirank import free_port

ROOT = Path(__file__).resolve().parents[2]

SAVE = """
import multiprocessing, os, sys
import torch, torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron_rl.checkpoint.dist import writer_queue_in_process
from megatron_rl.patches import apply_cpu_patches

def save(folder):
    weights = torch.arange(12.0).reshape(3, 4)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weights)}, folder)
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}, folder)
    assert torch.equal(loaded["w"], weights), loaded

apply_cpu_patches()  # (no-op on CUDA but for missing packages)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1)
writer_queue_in_process()
os.makedirs(f"{sys.argv[1]}/ours")
save(f"{sys.argv[1]}/ours")
print("ours:", multiprocessing.active_children(), flush=True)  # the manager is one
filesystem_async._results_queue = None  # megatron-core's own: why W31 exists
os.makedirs(f"{sys.argv[1]}/theirs")
save(f"{sys.argv[1]}/theirs")
print("theirs:", multiprocessing.active_children(), flush=True)
"""


def test_a_checkpoint_save_starts_no_process(tmp_path):
    done = subprocess.run([sys.executable, "-c", SAVE, str(tmp_path), str(free_port())], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = dict(line.split(":", 1) for line in done.stdout.splitlines() if line.startswith(("ours:", "theirs:")))
    assert lines["ours"].strip() == "[]", done.stdout  # the save and its load left no process behind
    # megatron-core's queue still starts its manager (when this fails, megatron-core changed: W31 can go)
    assert lines["theirs"].strip() != "[]", done.stdout
