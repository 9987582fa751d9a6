"""The ``rollout`` config section: which engine generates the rollouts, and how the vLLM engine runs.

Place in the data flow: read once by the job that builds the engine (``registry.start_engine``); the
library's ``MegatronRLConfig`` does not include it (a loop that generates elsewhere never sees it). The rules that
depend on the engine are the registry's (``registry.check_engine_config``: by the engine's declared capabilities,
then its own check, e.g. ``check_vllm_model``). YAML::

    rollout:
      engine: vllm            # builtin | vllm | a registered one (rollout.engine_module)
      num_engines: 2          # vllm serve servers the job starts (a fleet: inference/vllm/)
      sync_interval: 1        # RL steps between weight syncs
      bucket_mb: 64
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megatron_rl.config import AT_LEAST_1, POSITIVE, ConfigError, ConfigSection, ModelConfig, on_cpu, valid
from megatron_rl.hf.families import Family, family_of


@dataclass(kw_only=True)
class RolloutConfig(ConfigSection):
    SECTION: ClassVar[str] = "rollout"

    engine: str = "builtin"
    """A registered engine (``inference/registry.py``): 'builtin': the policy's own packed forward samples on
    every rank (no extra process); 'vllm': a vLLM engine in its own process and environment (``bash
    scripts/setup_engine.sh``), fed the policy's weights in place after every ``sync_interval`` RL steps; or the
    name an ``engine_module`` registers."""
    engine_module: str | None = None
    """A module of your own that registers an engine (``register_engine(name, factory, capabilities=...)``,
    docs/INFERENCE.md section 7): ``path/to/file.py`` (relative to the directory the job starts in) or
    ``package.module``; imported by every process that reads the config (the pre-flight, every rank) before
    ``engine`` is looked up. None: the shipped engines only."""
    num_engines: int = field(default=1, metadata=valid(0))
    """``vllm serve`` servers the job starts, each with ``engine_tensor_parallel_size`` devices; a GRPO group goes
    to one of them, groups are balanced by work. On a multi-node job engine ``i`` runs on node ``i % nnodes``,
    started by that node's local rank 0 (``inference/nodes.py``). On CPU a node's cores are split between its
    engines; on GPUs the node's ``k``-th engine gets its devices ``k*tp ...`` (modulo the visible ones: with fewer
    GPUs than that it shares the trainer's, ``gpu_memory_utilization``). 0 = only ``engine_urls``."""
    engine_nodes: int = field(default=0, metadata=valid(0))
    """Nodes of the fleet's own, the job's last ``engine_nodes``: they run the engines and no trainer rank; the
    trainer's ranks (and its world size, DP) are on the other nodes. Engine ``i`` runs on the ``i % engine_nodes``-th
    of them, started and restarted by that node's engine host (``run_megatron.sh`` runs ``python -m
    megatron_rl.inference.vllm.engine_host`` there instead of torchrun: ``inference/vllm/engine_host.py``; needs a file
    system the nodes share, as every multi-node job). 0 = engine ``i`` on node ``i % nnodes``, beside the trainer
    (``inference/nodes.py``). vLLM only; at most ``num_engines``, fewer than ``NNODES``
    (docs/PREEMPTION_AND_PLACEMENT.md)."""
    engine_host: str = "auto"
    """Multi-node jobs: the address each node's engines bind to, which global rank 0 must reach: 'auto' = the
    local address of the interface that routes to ``$MASTER_ADDR``, or this node's IP / host name (given in
    that node's own launch command; use 'auto' unless it picks the wrong interface). Single-node jobs always bind
    loopback. The job's engine token travels to the other nodes over the process group, never on a command line."""
    engine_urls: list[str] = field(default_factory=list)
    """Servers started elsewhere to use as well (``http://host:port``), each running ``python -m
    megatron_rl.inference.engine_process.vllm_serve`` with ``$MEGATRON_RL_ENGINE_TOKEN`` set (the job reads the
    same variable; docs/INFERENCE.md has the command line). The job never kills or restarts them."""
    engine_tensor_parallel_size: int = field(default=1, metadata=AT_LEAST_1)
    """Devices per engine (vLLM's ``--tensor-parallel-size``)."""
    request_timeout_s: float = field(default=600.0, metadata=POSITIVE)
    """An engine with requests outstanding that finishes none and generates no token for this long is taken as
    hung: it is killed and replaced, its requests go to the other engines."""
    sleep_while_training: bool = False
    """GPUs, engines sharing the trainer's devices (colocated): put every engine to sleep (vLLM sleep mode level
    1: KV cache freed, weights moved to host memory) before the optimizer steps and wake it before the weight sync,
    so that training has the device memory. Unmeasured (no GPU here); on CPU a ConfigError (there is no device
    memory to free)."""
    engine_python: str | None = None
    """Interpreter of the engine's environment; None = ``$MEGATRON_RL_ENGINE_PYTHON``, else
    ``.venv-engine/bin/python`` (what ``scripts/setup_engine.sh`` makes)."""
    weight_transport: Literal["auto", "gloo", "nccl", "disk"] = "auto"
    """How weights reach the engine: a torch.distributed group between the trainer's senders and the engine's
    workers ('gloo' on CPU, 'nccl' on GPUs; 'auto' picks by device), or 'disk' (HF safetensors written to
    ``sync_dir`` and reloaded by the engine: for an engine started elsewhere, or as a fallback)."""
    sync_interval: int = field(default=1, metadata=AT_LEAST_1)
    """RL steps between weight syncs (1 = the engine always samples from the newest policy; K > 1 = rollouts
    up to K-1 steps off-policy, which the rollout/old log-prob mismatch metrics show)."""
    max_staleness: int = field(default=0, metadata=valid(0))
    """Asynchronous RL: the rollouts of the next ``max_staleness`` steps are generated while the trainer trains
    (docs/INFERENCE.md section 6). The rollouts trained at step ``t`` were sampled from the weights of step
    ``t - 1 - max_staleness`` or newer (``rollout/staleness_max`` says how many versions older than the weights
    they train); 0 = generate, train, sync in turn (no overlap). With the vLLM fleet, generation runs on the
    engines during training; with the built-in engine (which is the policy itself) only the schedule changes."""
    partial_rollouts: bool = False
    """With ``max_staleness`` >= 1 on the vLLM fleet: a weight sync no longer waits for the generation in flight;
    its requests are paused (``/pause?mode=keep``), the weights swapped in place, and they finish on the new
    weights. Each token's weight version is recorded (the engines run with ``--enable-scale-out`` and answer on
    ``/inference/v1/generate``) and ``rollout/staleness_*`` count per token. Timing decides where a response
    switches weights, so a run is no longer reproducible (checkpoints still lose no prompt)."""
    bucket_mb: float = field(default=64.0, metadata=POSITIVE)
    """Size of one weight-sync message (MiB): the sender's extra memory is about one bucket plus the largest
    tensor."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Engine dtype; 'auto' = the policy's ``model.params_dtype``, except on CPU for a model family whose vLLM CPU
    kernels lack it (``Support.vllm_cpu_dtypes``; a hybrid Gated-DeltaNet model, Qwen3.5: bfloat16 only,
    ``engine_dtype``). The mean log-prob agreement
    each dtype allows is ``AGREEMENT_BOUNDS``, checked every on-policy step."""
    max_model_len: int | None = field(default=None, metadata=AT_LEAST_1)
    """Longest prompt + response the engine accepts; None = ``model.max_position_embeddings``."""
    gpu_memory_utilization: float = field(default=0.4, metadata=valid(0, 1, low_open=True))
    """Fraction of the GPU the engine may take (GPU only; the trainer shares the device)."""
    kv_cache_gib: float = field(default=1.0, metadata=POSITIVE)
    """KV-cache size on CPU (``VLLM_CPU_KVCACHE_SPACE``)."""
    start_timeout_s: float = field(default=600.0, metadata=POSITIVE)
    """Seconds the engine may take to start before the job stops with the tail of its log."""
    sync_timeout_s: float = field(default=600.0, metadata=POSITIVE)
    """Seconds an engine may take to take part in one weight sync (its receive call, each broadcast of its sync
    group): one that does not answer in time is marked down and replaced, the sync stands for the others."""
    sync_dir: str | None = None
    """Directory for the 'disk' transport's safetensors; None = ``/dev/shm`` when it exists, else the temp dir."""
    tool_call_parser: str = "hermes"
    """How the replies to a ``job.agent``'s calls are parsed into tool calls (the job parses: the engines run
    token-in/token-out): 'hermes' (``<tool_call>{json}</tool_call>`` blocks: Hermes, Qwen2.5, Qwen3) or 'none'
    (``megatron_rl/environments/agent/tool_parsers.py``, which registers more)."""

    def _check_rules(self) -> None:
        if isinstance(self.engine_urls, str):  # one URL given as a plain value
            self.engine_urls = [self.engine_urls]
        for url in self.engine_urls:
            if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
                raise ConfigError(f"rollout.engine_urls: {url!r} is not a server URL (http://host:port)")
        if self.engine_nodes:
            self._check_engine_nodes()
        if self.max_staleness and self.sleep_while_training:
            raise ConfigError(f"rollout.max_staleness={self.max_staleness} generates while the trainer trains, but "
                              "rollout.sleep_while_training=true puts the engines to sleep then; unset one of them")

    def _check_engine_nodes(self) -> None:
        from megatron_rl.inference.nodes import check_engine_nodes

        if self.sleep_while_training:
            raise ConfigError(f"rollout.engine_nodes={self.engine_nodes} gives the engines nodes of their own, but "
                              "rollout.sleep_while_training=true frees the trainer's devices they would share; unset "
                              "one of them")
        try:
            check_engine_nodes(self.engine_nodes, self.num_engines, all_nodes=self.engine_nodes + 1)
        except ValueError as err:
            raise ConfigError(str(err)) from None


AGREEMENT_BOUNDS = {"float32": 1e-4, "bfloat16": 2.0**-5}
"""Largest mean |engine - trainer| log-prob of the sampled tokens (``rollout/logprob_abs_diff_mean``) the job
accepts without a warning, on-policy, by the lower of the engine's and the trainer's precision.

fp32: both sides compute the same function in fp32 with different kernels; measured ~5e-6 mean, ~1e-5 max
(README's ``configs/demo_vllm.yaml`` row; the job tests assert a max <= 1e-4). bf16 keeps 8 significant bits:
unit roundoff u = 2^-8 ~ 3.9e-3, the rounding of one value. A log-prob is ``logit - logsumexp(logits)``; each
term comes out of bf16 matmuls and norms whose errors add up to a few u relative to their O(1-10) magnitude.
The bound is 8u = 2^-5 ~ 0.031 on the mean: ~40x the measured bf16-engine vs fp32-trainer gap (tiny Qwen3.5,
vllm-cpu 0.32: 8e-4 mean, 3.5e-3 max, tests/job/test_qwen35_job.py), far below what stale or wrong weights give
(0.22 mean after a missed sync at lr 1e-2; 0.1-0.6 for W19's stale output layer). The max is not checked:
near-tied tokens of a large model can move by more in bf16 alone."""

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention backend supports (vllm-cpu 0.32: ``CPUAttentionBackend.get_supported_head_sizes``;
any other fails at the first generation step, not at start-up)."""


def check_vllm_model(rollout: RolloutConfig, model: ModelConfig, device: str) -> None:
    """ConfigError for a model the vLLM fleet cannot run, before anything starts (the vLLM engine's registered
    check, ``registry.py``). ``model`` is the job's resolved model section: with ``model.hf_path``, the
    checkpoint's shapes and family (``job/config.py: load_job_config``), not the ``model.*`` keys it replaces; a
    checkpoint whose config.json is not there yet is left to its loader, which reports that."""
    if model.hf_path and not model.family:
        return
    if on_cpu(device):
        _check_cpu_dtype_and_linear_heads(rollout, model, family_of(model))
    if rollout.sleep_while_training and device == "cpu":
        raise ConfigError("rollout.sleep_while_training=true frees GPU memory for training, but parallel.device=cpu; "
                          "unset it (on CPU the engines use host memory)")
    if device != "cpu":
        return
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    if model.hf_path:
        source = f"model.hf_path={model.hf_path} has a head size of"
        fix = "use a checkpoint with one of those head sizes, or rollout.engine=builtin"
    else:
        source = (f"model.hidden_size={model.hidden_size} / model.num_attention_heads={model.num_attention_heads} "
                  "gives")
        fix = ("change model.num_attention_heads or set model.kv_channels (configs/demo_vllm.yaml uses 2 heads "
               "of 32)")
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ConfigError(f"rollout.engine=vllm on CPU needs a head size in {VLLM_CPU_HEAD_SIZES} (vLLM's CPU "
                          f"attention), but {source} {head_dim}; {fix}")


def engine_dtype(rollout: RolloutConfig, model: ModelConfig, device: str) -> tuple[str, str]:
    """The vLLM engine's dtype and why (a phrase for the start-up line)."""
    if rollout.dtype != "auto":
        return rollout.dtype, f"rollout.dtype={rollout.dtype}"
    family = family_of(model)
    dtypes = family.support.vllm_cpu_dtypes
    if on_cpu(device) and model.params_dtype not in dtypes:
        return dtypes[0], (family.support.vllm_cpu_dtype_why
                           or f"vLLM's CPU kernels run a {family.title or family.name} model in {' or '.join(dtypes)} only")
    return model.params_dtype, f"model.params_dtype={model.params_dtype}"


def on_policy(rollout: RolloutConfig, temperature: float, top_p: float) -> bool:
    """Whether an engine with its own weights samples from the trainer's current weights and distribution (then
    its log-probs must agree with the trainer's old log-probs): every step synced, no generation ahead,
    temperature 1, no top-p."""
    return rollout.sync_interval == 1 and rollout.max_staleness == 0 and temperature == 1.0 and top_p == 1.0


def agreement_bound(engine: str, trainer: str) -> float:
    """``AGREEMENT_BOUNDS`` of the lower of the two precisions."""
    return AGREEMENT_BOUNDS["float32" if engine == trainer == "float32" else "bfloat16"]


def _check_cpu_dtype_and_linear_heads(rollout: RolloutConfig, model: ModelConfig, family: Family) -> None:
    """ConfigError for a model vLLM's CPU kernels cannot run (its family's ``Support``): a dtype they lack (a
    hybrid Gated-DeltaNet model: bf16 only), or a Gated-DeltaNet head dim other than 64 or 128."""
    support = family.support
    if rollout.dtype != "auto" and rollout.dtype not in support.vllm_cpu_dtypes:
        why = support.vllm_cpu_dtype_why or f"vLLM's CPU kernels run it in {' or '.join(support.vllm_cpu_dtypes)} only"
        raise ConfigError(f"rollout.dtype={rollout.dtype} with a {family.title or family.name} model on CPU: {why}; set "
                          f"rollout.dtype=auto ({support.vllm_cpu_dtypes[0]} here) or rollout.engine=builtin")
    if support.vllm_cpu_linear_head_dims is None:
        return
    where = f"model.hf_path={model.hf_path} has " if model.hf_path else "model."
    for name in ("linear_key_head_dim", "linear_value_head_dim"):
        dim = getattr(model, name)
        if dim not in support.vllm_cpu_linear_head_dims:
            raise ConfigError(f"rollout.engine=vllm on CPU needs a Gated-DeltaNet head dim in "
                              f"{support.vllm_cpu_linear_head_dims} (vLLM's CPU GDN kernels), but {where}{name}={dim}; "
                              "use a model with one of those, or rollout.engine=builtin")
