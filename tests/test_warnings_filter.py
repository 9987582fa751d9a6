"""Quiet as promised: the warnings megatron-core's own calls raise (a resume's torch.distributed.checkpoint
warnings, a train step's "tp_group is None") print nothing; any other warning still does
(``megatron_rl/warnings_filter.py: MEGATRON_CORE_CALL_WARNINGS``, docs/MEGATRON_CORE.md W17)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_rl.warnings_filter import MEGATRON_CORE_CALL_WARNINGS

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [text for _, text in MEGATRON_CORE_CALL_WARNINGS]


def _stderr_of(code: str, *, debug: bool = False, python_args: tuple[str, ...] = ()) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["MEGATRON_RL_DEBUG"] = "1" if debug else ""
    done = subprocess.run([sys.executable, *python_args, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_megatron_core_call_warnings_print_nothing_other_warnings_do() -> None:
    code = """
        import warnings
        import megatron_rl
        from megatron_rl.warnings_filter import MEGATRON_CORE_CALL_WARNINGS
        warnings.simplefilter("always")
        for category, text in sorted(MEGATRON_CORE_CALL_WARNINGS, key=str):
            warnings.warn(text, category)
        warnings.warn("tp_group is None, using default tp group (another text)", DeprecationWarning)
    """
    output = _stderr_of(code)
    assert not any(text in output for text in TEXTS), output
    assert "(another text)" in output  # exact texts only
    assert all(text in _stderr_of(code, debug=True) for text in TEXTS)  # MEGATRON_RL_DEBUG=1 shows them


def test_the_no_cuda_runtime_log_of_torch_cpp_extension_prints_nothing_other_logs_do() -> None:
    code = """
        import logging
        import megatron_rl
        log = logging.getLogger("torch.utils.cpp_extension")  # what torch.utils.cpp_extension logs at import
        log.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local/cuda")
        log.warning("another cpp_extension warning")
    """
    output = _stderr_of(code)
    assert "No CUDA runtime is found" not in output and "another cpp_extension warning" in output
    assert "No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'" in _stderr_of(code, debug=True)


@pytest.mark.slow
def test_a_library_train_step_and_a_resume_print_none_of_them(tmp_path: Path) -> None:
    """One process: a Trainer.train_step (deprecation warnings shown: ``-W always``), a save, and a resume."""
    code = f"""
        import sys
        from megatron_rl.checkpoint import load_checkpoint, save_checkpoint
        from megatron_rl.config import load_config
        from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed
        from megatron_rl.model.policy import MegatronPolicy
        from megatron_rl.trainer import Trainer
        cfg = load_config(None, ["model.vocab_size=32", "model.num_layers=2", "model.hidden_size=32",
                                 "model.ffn_hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
                                 "batch.train_batch_size=2", "batch.policy_mini_batch_size=2"], world_size=1)
        groups = initialize_distributed(cfg.parallel, cfg.seed)
        policy = MegatronPolicy(cfg, groups, pad_token_id=0)
        Trainer(cfg, policy).train_step({{"prompt_token_ids": [[1, 2], [1, 2], [3], [3]],
            "response_ids": [[4, 5], [6], [7, 8], [9]], "rewards": [1.0, 0.0, 0.5, 0.0],
            "loss_masks": [[1, 1], [1], [1, 1], [1]], "uids": [0, 0, 1, 1]}})
        save_checkpoint(policy, {str(tmp_path)!r}, {{"step": 1}})
        load_checkpoint(MegatronPolicy(cfg, groups, pad_token_id=0), {str(tmp_path)!r})
        destroy_distributed()
        print("done")
    """
    output = _stderr_of(code, python_args=("-W", "always"))
    assert "done" in output
    assert not any(text in output for text in TEXTS), output
