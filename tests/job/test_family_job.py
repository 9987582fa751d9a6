"""The model-family registry's proof (docs/HF.md section 8): a family defined in this very file, a Llama renamed
``my_llama`` (its transformers classes registered here too) read and written through mbridge's Llama bridge, is
named by ``model.family=<this file>:MY_LLAMA``; the main job (``run_megatron.sh``: the pre-flight and every rank
import this file, as they import a ``reward.function`` file) trains it for two steps and exports it to HF, with
no library edit. And one job's set-up parses the checkpoint's config.json once per process.

Cost: the set-up test ~10 s (one rank in-process, a 2-layer model); the main-job test ~1 min (2 ranks, 2 steps).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from megatron_rl.hf.families import DenseFamily


class MyLlamaConfig(LlamaConfig):
    model_type = "my_llama"


class MyLlamaForCausalLM(LlamaForCausalLM):
    config_class = MyLlamaConfig


AutoConfig.register("my_llama", MyLlamaConfig, exist_ok=True)
AutoModelForCausalLM.register(MyLlamaConfig, MyLlamaForCausalLM, exist_ok=True)

MY_LLAMA = DenseFamily(name="my_llama", model_types=("my_llama",), types={"my_llama": {}},
                       bridges={"my_llama": "llama"})
"""A dense family of our own: config mapping and weights as Llama's (mbridge's ``llama`` bridge)."""

FAMILY = f"model.family={__file__}:MY_LLAMA"


def make_task(path: Path) -> dict[str, Path]:
    """A tiny ``my_llama`` checkpoint with a tokenizer, prompts with a target, and a reward function file."""
    import torch
    from tests.support.job_run import example_module

    model = path / "model"
    vocab = example_module("examples/arithmetic/make_model.py").save_tokenizer(model)
    config = MyLlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=32, vocab_size=vocab, max_position_embeddings=64,
                           rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, tie_word_embeddings=True,
                           pad_token_id=0, eos_token_id=2)
    torch.manual_seed(3)
    MyLlamaForCausalLM(config).save_pretrained(model)
    rows = [{"prompt": f"{a} plus one equals", "target": str((a + 1) % 10)} for a in range(10)]
    (path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "my_reward.py").write_text("def match(prompt, response, target):\n"
                                       "    return float(response.split()[:1] == [target])\n")
    return {"model": model, "data": path / "prompts.jsonl", "reward": path / "my_reward.py"}


def overrides(task: dict[str, Path], out_dir: Path) -> list[str]:
    return [f"model.hf_path={task['model']}", FAMILY, f"data.train_files={task['data']}",
            f"reward.function={task['reward']}:match", f"logging.output_dir={out_dir}", "logging.progress_bar=false",
            "batch.train_batch_size=4", "job.num_steps=2"]


def test_one_job_set_up_reads_config_json_once(tmp_path):
    """The job's config (the pre-flight's load and every rank's), its environment, the policy with the
    checkpoint's weights and an HF export: config.json parsed once (it was 7 entries into hf/config.py)."""
    from tests.support.job_run import ROOT

    from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed
    from megatron_rl.environments.registry import make_environment
    from megatron_rl.hf import config as hf_config
    from megatron_rl.hf.weights import export_policy_to_hf
    from megatron_rl.job.config import load_job_config
    from megatron_rl.job.main import build_policy

    task = make_task(tmp_path)
    before = hf_config.configs_read()
    config = load_job_config(ROOT / "configs" / "user_job.yaml", overrides(task, tmp_path / "out"))
    assert config.rl.model.family.endswith(":MY_LLAMA")
    assert (config.rl.model.num_layers, config.rl.model.kv_channels) == (2, 32)  # the checkpoint's, resolved at load
    environment = make_environment(config)
    groups = initialize_distributed(config.rl.parallel, config.rl.seed)
    try:
        policy = build_policy(config, groups, environment.pad_token_id)
        export_policy_to_hf(policy, tmp_path / "hf")
    finally:
        destroy_distributed()
    assert hf_config.configs_read() - before == 1
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "my_llama"


@pytest.mark.multirank
def test_a_family_defined_in_a_test_file_trains_and_exports(tmp_path):
    import torch
    from tests.support.job_run import run_megatron

    task = make_task(tmp_path)
    out = tmp_path / "out"
    stdout = run_megatron(*overrides(task, out)).stdout
    assert f"{task['model']} (my_llama)" in stdout  # the load line: read by the family of this file
    exported = out / "hf" / "step_2"
    assert json.loads((exported / "config.json").read_text())["model_type"] == "my_llama"
    trained = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(task["model"], dtype=torch.float32)
    assert type(trained).__name__ == "MyLlamaForCausalLM"  # (this file may be loaded twice in one process)
    assert trained.state_dict().keys() == original.state_dict().keys()
    changed = [n for n, p in trained.named_parameters() if not torch.equal(p, original.get_parameter(n))]
    assert changed, "the export holds the trained weights, not the initial ones"
