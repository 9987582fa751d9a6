"""The demo's config: library sections plus ``demo:`` from one YAML, the moved group-size key, and the main
job's handling of a config mistake (printed once by rank 0, exit code 2, no traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import MegatronRLConfig
from megatron_rl.job.config import JobConfig, JobSection, dump_job_config, load_job_config

ROOT = Path(__file__).resolve().parents[2]
CPU = ROOT / "configs" / "demo_cpu.yaml"


def test_library_schema_has_no_demo_fields():
    names = {f for f in MegatronRLConfig.__dataclass_fields__}
    assert "demo" not in names
    assert "n_samples_per_prompt" not in MegatronRLConfig().batch.__dataclass_fields__


def test_demo_overrides_and_the_moved_group_size_key():
    job = load_job_config(CPU, ["demo.num_steps=5", "optimizer.lr=1e-4"])
    assert (job.job.num_steps, job.job.n_samples_per_prompt, job.rl.optimizer.lr) == (5, 8, 1e-4)
    old_spelling = load_job_config(CPU, ["batch.n_samples_per_prompt=3"])
    assert old_spelling.job.n_samples_per_prompt == 3  # the old key still works, and the later value wins
    assert load_job_config(CPU, ["batch.n_samples_per_prompt=3", "demo.n_samples_per_prompt=5"]).job \
        .n_samples_per_prompt == 5


@pytest.mark.parametrize(
    "override, needle",
    [
        ("demo.num_steps=0", "job.num_steps=0 is out of range"),
        ("demo.temperature=-1", "job.temperature=-1.0 is out of range"),
        ("demo.n_samples_per_prompt=0", "job.n_samples_per_prompt=0 is out of range"),
        ("batch.n_samples_per_prompt=0", "job.n_samples_per_prompt=0 is out of range"),
        ("job.num_step=3", "did you mean 'job.num_steps'"),
        ("job.group_size=3", "did you mean 'job.n_samples_per_prompt'"),
        ("model.vocab_size=32", "model.vocab_size=32 but the demo tokenizer has 16"),
        ("optimizer.lr=.inf", "optimizer.lr=inf is out of range"),
        # the rollout shapes the config decides (3 turns x (3 new tokens + 3) = 18 tokens), found at load
        ("model.max_position_embeddings=17", "set model.max_position_embeddings=18 (or more)"),
        ("batch.max_tokens_per_micro_batch=17", "set batch.max_tokens_per_micro_batch=18 (or more)"),
    ],
)
def test_demo_config_errors_name_the_key(override, needle):
    overrides = [override, "batch.micro_batch_size=null"] if "max_tokens" in override else [override]
    with pytest.raises(ValueError, match=needle.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        load_job_config(CPU, overrides)


def test_rollout_shapes_at_the_bound_and_packed_for_cp():
    assert load_job_config(CPU, ["model.max_position_embeddings=18", "batch.micro_batch_size=null",
                                  "batch.max_tokens_per_micro_batch=18"])
    with pytest.raises(ValueError, match=r"packed to 20 \(a multiple of 4\); set batch.max_tokens_per_micro_batch=20"):
        load_job_config(CPU, ["parallel.context_parallel_size=2", "batch.micro_batch_size=null",
                               "batch.max_tokens_per_micro_batch=18"])


def test_dump_round_trip(tmp_path):
    job = load_job_config(CPU, ["demo.num_steps=7"])
    dump_job_config(job, tmp_path / "config.yaml")
    assert load_job_config(tmp_path / "config.yaml") == job
    assert JobConfig(rl=job.rl, job=JobSection(num_steps=7, n_samples_per_prompt=8)) == job


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_main_prints_a_config_error_once_and_exits_2(monkeypatch, capsys, rank, printed):
    from megatron_rl.job.main import main

    monkeypatch.setenv("RANK", rank)
    assert main(["--config", str(CPU), "optimizer.lr=.inf"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    if printed:
        assert err.strip() == "megatron_rl: config error: optimizer.lr=inf is out of range; it must be finite and > 0"
    else:
        assert err == ""


def test_main_world_size_error_before_any_collective(monkeypatch, capsys):
    import torch.distributed as dist

    from megatron_rl.job.main import main

    for key, value in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    assert main(["--config", str(CPU), "parallel.tensor_model_parallel_size=2"]) == 2
    assert "world size 3 is not divisible" in capsys.readouterr().err
    assert not dist.is_initialized()


def test_a_finished_run_says_so_in_one_line_and_rewrites_nothing(monkeypatch, capsys, tmp_path):
    """Run again after its last step (here: the checkpoint is at step 5, demo.num_steps=5): exit code 0, one
    line naming the step and the keys to change, and no file of the output directory is written."""
    from types import SimpleNamespace

    import megatron_rl.job.main as main_module

    out = tmp_path / "out"
    out.mkdir()
    job = SimpleNamespace(config=load_job_config(CPU, ["demo.num_steps=5", f"logging.output_dir={out}"]),
                          save_dir=out / "checkpoints", is_rank0=True)
    monkeypatch.setattr(main_module, "resume", lambda job: 5)
    assert main_module.run(job) == 0
    printed, err = capsys.readouterr()
    assert err == "" and printed.count("\n") == 1, printed
    assert "finished at step 5" in printed and "job.num_steps=10" in printed and "logging.output_dir" in printed
    assert list(out.iterdir()) == []  # no config.yaml, summary.txt, plot, metrics or TensorBoard events
