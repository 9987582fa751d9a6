"""No silent guesses about a user's HF folder, and a quiet load.

- A folder without tokenizer files (transformers 5.x would build a one-token stand-in with pad id 0) is
  refused by ``load_tokenizer`` and ``policy_from_hf`` with a ValueError naming both fixes; an explicit
  ``pad_token_id=`` loads it.
- ``policy_from_hf`` prints the values it took from config.json / the tokenizer in one line (rank 0).
- Building a policy prints at most one line about megatron-core/mbridge's known fallback warnings
  (``megatron_rl/warnings_filter.py``); ``MEGATRON_RL_DEBUG=1`` shows them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron_rl import warnings_filter
from megatron_rl.hf.tokenizer import TOKENIZER_FILES, load_tokenizer

pytestmark = pytest.mark.slow  # a subprocess per test

CHILD = """
import sys
from megatron_rl.config import MegatronRLConfig
from megatron_rl.distributed.bootstrap import initialize_distributed
from megatron_rl.hf import policy_from_hf
cfg = MegatronRLConfig()
groups = initialize_distributed(cfg.parallel, cfg.seed)
try:
    policy_from_hf(cfg, groups, hf_dir=sys.argv[1])
except ValueError as err:
    print("REFUSED:", err)
policy = policy_from_hf(cfg, groups, hf_dir=sys.argv[1], pad_token_id=3)
print("PAD", policy.pad_token_id)
"""


def _without_tokenizer(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for path in src.iterdir():
        if path.name in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(path, dst / path.name)
    return dst


def test_load_tokenizer_refuses_a_folder_without_tokenizer_files(hf_models, tmp_path):
    bare = _without_tokenizer(hf_models["qwen3"], tmp_path / "bare")
    with pytest.raises(ValueError, match="add the tokenizer files.*pad_token_id=") as err:
        load_tokenizer(bare)
    assert str(bare) in str(err.value) and TOKENIZER_FILES[0] in str(err.value)


def _run_child(hf_dir: Path, debug: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["MEGATRON_RL_DEBUG"] = "1" if debug else ""
    done = subprocess.run([sys.executable, "-c", CHILD, str(hf_dir)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_policy_from_hf_explicit_pad_id_one_load_line_and_quiet(hf_models, tmp_path):
    bare = _without_tokenizer(hf_models["llama"], tmp_path / "bare")
    output = _run_child(bare, debug=False)
    assert "REFUSED:" in output and "pass the pad id explicitly" in output
    assert "PAD 3" in output
    load_lines = [line for line in output.splitlines() if line.startswith("megatron_rl.hf:")]
    assert len(load_lines) == 1, output
    for value in ("(llama)", "vocab 256", "pad id 3 (pad_token_id argument)", "dtype float32", "tied embeddings False"):
        assert value in load_lines[0]
    noise = [line for line in output.splitlines() if "Falling back" in line or "deprecated" in line
             or "TransformerEngine" in line or "Apex" in line]  # fmt: skip
    assert noise == [warnings_filter.SUMMARY], output
    debug_output = _run_child(bare, debug=True)
    assert "Falling back to Torch Norm" in debug_output and warnings_filter.SUMMARY not in debug_output


def test_filter_matches_exact_texts_only():
    known = next(iter(warnings_filter.KNOWN_FALLBACK_WARNINGS))
    assert warnings_filter.is_known_fallback(UserWarning(known), UserWarning)
    assert not warnings_filter.is_known_fallback(UserWarning(known + " (other)"), UserWarning)
    assert not warnings_filter.is_known_fallback(DeprecationWarning(known), DeprecationWarning)
    with warnings.catch_warnings(record=True) as caught:  # recording is untouched by the filter
        warnings.simplefilter("always")
        warnings.warn(known, UserWarning)
    assert len(caught) == 1
