"""A one-rank process that saves checkpoints in a loop until it is killed (driven by test_ckpt_crash.py).

    PYTHONPATH=<repo> python -m tests.support.ckpt_worker SAVE_DIR [--fault STAGE:ACTION --fault-step N]

Before saving step k it sets every parameter to ``initial + k`` (initial = the seeded init of
``ckpt_helpers.make_config``), so a loaded checkpoint tells by its weights which step it holds; a mix of two
saves shows up as weights that disagree with the trainer state. The fault spec (``layout.fault_point``) is
armed only for step N. The ``__main__`` guard is required: dist_checkpointing's helper process re-imports the
entry script.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("save_dir")
    parser.add_argument("--fault", default=None)
    parser.add_argument("--fault-step", type=int, default=-1)
    parser.add_argument("--max-steps", type=int, default=10_000)
    args = parser.parse_args()

    from tests.support.ckpt_helpers import local_weights, make_config, set_weights_to_step

    from megatron_rl.checkpoint import save_checkpoint
    from megatron_rl.checkpoint.layout import FAULT_ENV
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.model.policy import MegatronPolicy

    config = make_config(keep_last=2)
    policy = MegatronPolicy(config, initialize_distributed(config.parallel, seed=config.seed))
    base = local_weights(policy)
    for step in range(1, args.max_steps + 1):
        if step == args.fault_step:
            os.environ[FAULT_ENV] = args.fault
        set_weights_to_step(policy, base, step)
        save_checkpoint(policy, args.save_dir, {"step": step})


if __name__ == "__main__":
    main()
