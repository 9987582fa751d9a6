"""Process-group bootstrap: the first Megatron stage of a run (docs/DESIGN.md section 7).

    torchrun env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), or nothing for one process
      -> the device (``parallel.device``: cuda:LOCAL_RANK, or CPU; ``select_device``)
      -> torch.distributed process group (NCCL on CUDA, gloo on CPU; CPU patches applied once on CPU)
      -> megatron-core parallel_state (order tp-cp-ep-dp-pp: TP ranks are adjacent; EP ranks are DP ranks of
         the dense layers, docs/MOE.md)
      -> seeds (python, numpy, torch, megatron's model-parallel RNG tracker)
      -> ParallelGroups, passed explicitly to everything after this point

Seeding follows megatron's training loop: every stage seeds ``seed + 100 * pp_rank`` (TP and DP ranks of a
stage share the seed, so ``use_cpu_initialization`` gives identical full weights on every TP rank and DDP
replicas start equal); ``model_parallel_cuda_manual_seed`` adds the TP-rank-dependent model-parallel RNG
state used by dropout inside model-parallel regions.
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError, ParallelConfig

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the TP x CP x DP x PP grid, and the process groups to pass around."""

    rank: int
    world_size: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    cp_size: int
    cp_rank: int
    is_first_stage: bool
    is_last_stage: bool
    sequence_parallel: bool
    tp_group: ProcessGroup
    pp_group: ProcessGroup
    dp_group: ProcessGroup
    """Data-parallel group without context parallelism."""
    dp_cp_group: ProcessGroup
    """Data x context parallel group: the group DDP reduces over."""
    cp_group: ProcessGroup
    mp_group: ProcessGroup
    """Model-parallel (TP x PP) group."""
    embd_group: ProcessGroup | None
    """First and last PP stage (tied embedding grads); None-like on other ranks as in megatron."""
    pos_embd_group: ProcessGroup | None
    pg_collection: object
    """megatron.core.process_groups_config.ProcessGroupCollection of all the above (megatron's names)."""
    device: torch.device
    """Where tensors of this rank live (cuda:LOCAL_RANK or cpu)."""
    ep_size: int = 1
    """Expert-parallel size (MoE): the experts of a layer are split over the ``ep_group``."""
    ep_rank: int = 0
    etp_size: int = 1
    """Expert-tensor-parallel size (each expert's linear layers split over ``etp_group``)."""
    etp_rank: int = 0
    ep_group: ProcessGroup | None = None
    etp_group: ProcessGroup | None = None
    expert_dp_group: ProcessGroup | None = None
    """Ranks holding the same experts (DDP reduces expert gradients over it)."""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hide_cuda() -> None:
    """Make CUDA invisible to this process (``parallel.device='cpu'``); must run before CUDA is first queried.

    torch counts the devices once per process (on the first ``torch.cuda`` query) and keeps that count, so
    hiding them afterwards has no effect: that case is a RuntimeError saying how to launch instead.
    """
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if torch.cuda.is_available():
        raise RuntimeError(
            "parallel.device='cpu' but this process queried CUDA before initialize_distributed, so its GPUs can no "
            "longer be hidden; start the process with CUDA_VISIBLE_DEVICES= (run_megatron.sh does for "
            "parallel.device=cpu)"
        )


def select_device(parallel: ParallelConfig, local_world_size: int, local_rank: int) -> torch.device:
    """This rank's device from ``parallel.device`` (``auto``: CUDA when visible); ConfigError before any
    collective when CUDA is asked for but absent, or when more ranks share a node than it has GPUs (NCCL
    refuses two ranks on one GPU)."""
    if parallel.device == "cpu":
        hide_cuda()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        if parallel.device == "cuda":
            raise ConfigError("parallel.device='cuda' but no CUDA device is visible; set parallel.device=auto "
                              "(CPU with gloo here) or run on a machine with a GPU")
        return torch.device("cpu")
    if local_world_size > gpus:
        raise ConfigError(
            f"{local_world_size} ranks on this node but {gpus} visible CUDA GPU(s) (parallel.device="
            f"{parallel.device!r}; NCCL needs one GPU per rank): start at most {gpus} rank(s) per node (NPROC={gpus}), "
            "or set parallel.device=cpu to run the ranks on CPU with gloo"
        )
    return torch.device("cuda", local_rank)


def _init_process_group(device: torch.device, timeout_minutes: int) -> None:
    """Join the torchrun job described by the env, or start a one-rank group on a free local port."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if "WORLD_SIZE" in os.environ:  # torchrun (or run_ranks): env:// also needs MASTER_ADDR/PORT, RANK
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(backend, init_method=init_method, rank=0, world_size=1, timeout=timeout)


def _seed_everything(seed: int, pp_rank: int) -> None:
    from megatron.core import tensor_parallel

    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def initialize_distributed(
    parallel: ParallelConfig, seed: int, *, timeout_minutes: int = 30
) -> ParallelGroups:
    """Initialize torch.distributed (if needed) and megatron-core's parallel state; return the groups.

    Raises ValueError (before any collective) when the world size is not divisible by
    tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size, or when
    ``parallel.device`` cannot be met (``select_device``). A process group that
    already exists (e.g. created by the caller) is reused; megatron's parallel state must not exist yet
    (call ``destroy_distributed`` first).
    """
    world_size = dist.get_world_size() if dist.is_initialized() else _env_int("WORLD_SIZE", 1)
    parallel.check_world_size(world_size)  # the one place the world-size rule runs in a job
    # Before megatron-core is imported: it may query CUDA, after which parallel.device='cpu' cannot hide it.
    device = select_device(parallel, _env_int("LOCAL_WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0))
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron parallel state is already initialized; call destroy_distributed() first")
    from megatron_rl.patches import apply_cpu_patches

    apply_cpu_patches()  # with CUDA only those for a missing optional package (Patch.on_cuda: fla)
    if device.type != "cpu":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        _init_process_group(device, timeout_minutes)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_size,
        distributed_timeout_minutes=timeout_minutes,
    )
    groups = _collect_groups(parallel, device)
    _seed_everything(seed, groups.pp_rank)
    return groups


def _collect_groups(parallel: ParallelConfig, device: torch.device) -> ParallelGroups:
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    return ParallelGroups(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=pp_size,
        pp_rank=pp_rank,
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        is_first_stage=pp_rank == 0,
        is_last_stage=pp_rank == pp_size - 1,
        sequence_parallel=parallel.sequence_parallel,
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        cp_group=ps.get_context_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
        embd_group=ps.get_embedding_group(check_initialized=False),
        pos_embd_group=ps.get_position_embedding_group(check_initialized=False),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        device=device,
        ep_size=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(),
        etp_group=ps.get_expert_tensor_parallel_group(),
        expert_dp_group=ps.get_expert_data_parallel_group(),
    )


def destroy_distributed(*, keep_process_group: bool = False) -> None:
    """Tear down megatron's parallel state and the process group (safe to call twice).

    ``keep_process_group=True`` keeps torch.distributed's default group so that ``initialize_distributed``
    can set up another layout in the same processes (re-creating the group from the same torchrun env
    would rendezvous on a port whose store is gone).
    """
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized() and not keep_process_group:
        dist.destroy_process_group()
