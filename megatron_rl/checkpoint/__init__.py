"""Atomic distributed checkpoints and resume (docs/DESIGN.md section 1, last stage).

``save_checkpoint(policy, save_dir, trainer_state)`` / ``load_checkpoint(policy, path)`` (``dist.py``; ``policy`` is
any ``CheckpointablePolicy``, e.g. a ``MegatronPolicy``), the on-disk layout and its crash safety
(``layout.py``), the megatron optimizer state with the 0.16.1 fixes (``optimizer_state.py``), RNG states
(``rng.py``); a run with a critic: ``save_with_critic`` / ``load_with_critic`` (``critic.py``).
"""

from megatron_rl.checkpoint.dist import CheckpointablePolicy, CheckpointParts, load_checkpoint, load_parts, save_checkpoint, save_parts
from megatron_rl.checkpoint.layout import resolve_checkpoint
from megatron_rl.checkpoint.critic import load_with_critic, save_with_critic

__all__ = ["CheckpointablePolicy", "CheckpointParts", "load_checkpoint", "load_parts", "load_with_critic", "resolve_checkpoint",
           "save_checkpoint", "save_parts", "save_with_critic"]
