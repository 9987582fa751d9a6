"""Process groups and collectives (one of the two places that touch torch.distributed; see bootstrap.py)."""

from megatron_rl.distributed.bootstrap import ParallelGroups, destroy_distributed, initialize_distributed

__all__ = ["ParallelGroups", "destroy_distributed", "initialize_distributed"]
