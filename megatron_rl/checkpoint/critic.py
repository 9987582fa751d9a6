"""Checkpoints of a run with a critic: the policy's checkpoint plus the critic's, saved by the same machinery.

Place in the data flow: where a run with a critic saves and resumes (the main job, ``job/main.py``). Layout::

    save_dir/
      latest, step_00000010/ ...   the policy (model, optimizer, LR schedule, RNG, trainer state): dist.py
      critic/
        latest, step_00000010/ ... the critic's own atomic checkpoints (same format, same keep_last)

The critic is saved FIRST, so a complete policy checkpoint of step n implies a complete critic checkpoint of
step n (a crash in between leaves a critic step the policy does not have, which is never read). Resume loads
the policy (with its verification and fallback), then the critic checkpoint of exactly that step: a run never
resumes a policy and a critic of different steps.
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl.checkpoint import layout
from megatron_rl.checkpoint.dist import CheckpointablePolicy, TrainerState, load_checkpoint, save_checkpoint

CRITIC_DIR = "critic"
"""Subdirectory of the policy's save_dir that holds the critic's checkpoints."""


def critic_save_dir(save_dir: str | Path) -> Path:
    """Where the critic of the run saving into ``save_dir`` keeps its checkpoints."""
    return Path(save_dir) / CRITIC_DIR


def save_with_critic(policy: CheckpointablePolicy, critic: CheckpointablePolicy | None, save_dir: str | Path,
                     trainer_state: TrainerState) -> Path:
    """``save_checkpoint`` of the critic (into ``save_dir/critic``), then of the policy; returns the policy's
    checkpoint directory. ``critic=None``: the policy alone. Collective."""
    if critic is not None:
        save_checkpoint(critic, critic_save_dir(save_dir), trainer_state)
    return save_checkpoint(policy, save_dir, trainer_state)


def load_with_critic(policy: CheckpointablePolicy, critic: CheckpointablePolicy | None, path: str | Path, *,
                     load_optimizer: bool = True) -> TrainerState:
    """``load_checkpoint`` of the policy from ``path`` (a save_dir or one of its step directories), then of the
    critic checkpoint of the same step; ValueError naming the directory when the critic has none. Collective."""
    state = load_checkpoint(policy, path, load_optimizer=load_optimizer)
    if critic is None:
        return state
    path = Path(path)
    save_dir = path.parent if (path / layout.MANIFEST_FILE).is_file() else path
    critic_ckpt = critic_save_dir(save_dir) / layout.checkpoint_name(int(state["step"]))
    if not (critic_ckpt / layout.MANIFEST_FILE).is_file():
        raise ValueError(f"the run has a critic but {critic_ckpt} is not a complete critic checkpoint (the policy "
                         f"resumed from step {state['step']}); restore it, or start the critic fresh elsewhere")
    load_checkpoint(critic, critic_ckpt, load_optimizer=load_optimizer, fallback=False)
    return state
