"""A one-process trainer that starts the real vLLM engine, for the engine tests (run as a script).

    PYTHONPATH=<repo> python -m tests.support.engine_trainer MODE HF_DIR WORK_DIR [OVERRIDES...]

MODE:
- ``wait``: start the engine, write its pid (= its process group) to ``WORK_DIR/engine.pid``, then sleep until
  killed (the lifecycle tests send SIGKILL or SIGINT);
- ``raise``: start the engine, write the pid, then raise (an error in the training loop);
- ``digests``: 3 RL steps, then a sync with digests; prints JSON ``{"engine": {name: sha256}, "export":
  {name: sha256}}`` (the trainer's HF export of the same weights) on the last line;
- ``start``: start the engine with ``rollout.*`` overrides and print the error it raises, if any.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path


def _policy(hf_dir: str):
    from megatron_rl.config import load_config
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.hf import policy_from_hf

    cfg = load_config(None, ["parallel.device=cpu", "optimizer.lr=1e-3", "optimizer.lr_warmup_steps=0",
                             "batch.train_batch_size=2", "batch.policy_mini_batch_size=2"], world_size=1)
    groups = initialize_distributed(cfg.parallel, cfg.seed)
    return policy_from_hf(cfg, groups, hf_dir=hf_dir)


def _rollout_config(overrides: list[str]):
    from megatron_rl.config import build_config, read_overrides
    from megatron_rl.inference.config import RolloutConfig

    return build_config(RolloutConfig, read_overrides(None, ["rollout.engine=vllm", *overrides]), "rollout.")


def main(mode: str, hf_dir: str, work_dir: str, *overrides: str) -> int:
    # Ctrl-C as in a terminal: a process started in the background by a non-interactive shell (e.g. a CI runner's
    # `cmd &`) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from megatron_rl.inference.engine import SamplingSpec
    from megatron_rl.inference.engine import EngineStartError
    from megatron_rl.inference.vllm.engine import VLLMEngine

    policy = _policy(hf_dir)
    if mode == "start":
        try:
            VLLMEngine.start(policy, _rollout_config(list(overrides)), hf_dir=hf_dir, work_dir=work_dir).close()
        except EngineStartError as err:
            print(json.dumps({"error": str(err)}))
            return 0
        print(json.dumps({"error": None}))
        return 0
    engine = VLLMEngine.start(policy, _rollout_config(list(overrides)), hf_dir=hf_dir, work_dir=work_dir)
    try:
        if mode in ("wait", "raise"):
            pids = [slot.server.proc.pid for slot in engine.fleet.slots]  # each server leads its process group
            (Path(work_dir) / "engine.pid").write_text(" ".join(map(str, pids)))
            if mode == "raise":
                raise RuntimeError("planted error in the training loop")
            while True:
                time.sleep(1)
        assert mode == "digests", mode
        from megatron_rl.hf.weights import export_hf
        from megatron_rl.inference.engine_process.vllm_worker import tensor_digest
        from megatron_rl.trainer import Trainer
        from safetensors.torch import load_file

        trainer = Trainer(policy.config, policy)
        spec = SamplingSpec(max_tokens=5, stop_token_ids=(2,))
        for step in range(3):
            prompts = [[5, 6, 7]] * 2 + [[9, 10]] * 2
            out = engine.generate(prompts, spec, seed=step)
            trainer.train_step({
                "prompt_token_ids": prompts, "response_ids": [c.token_ids for c in out],
                "rewards": [float(len(c.token_ids)) for c in out], "loss_masks": [[1] * len(c.token_ids) for c in out],
                "uids": [0, 0, 1, 1], "rollout_logprobs": [c.logprobs for c in out],
            })  # fmt: skip
            engine.record_digests = step == 2
            engine.update_weights(policy)
        export = export_hf([policy.module], Path(work_dir) / "export", hf_dir, policy.groups)
        tensors = {}
        for path in sorted(export.glob("*.safetensors")):
            tensors.update(load_file(path))
        engines = [engine.digests(i) for i in range(len(engine.fleet.slots))]
        assert all(d == engines[0] for d in engines[1:]), "the engines received different weights"
        print(json.dumps({"engine": engines[0], "engines": len(engines), "export": {k: tensor_digest(v) for k, v in tensors.items()}}))
        return 0
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
