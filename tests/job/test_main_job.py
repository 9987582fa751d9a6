"""The main job end to end, launched the way the README says (``run_megatron.sh`` -> torchrun -> main).

Three launches, each a few RL steps of ``configs/demo_cpu.yaml`` on 2 gloo ranks (``parallel.device=cpu``: on a
machine with GPUs too, where NCCL could not put two ranks on one GPU):

1. DP2 on one node for 2 steps, with the README's command (``bash scripts/setup.sh && bash run_megatron.sh``)
   plus overrides: exit 0, finite losses, every output file, a checkpoint at step 2;
2. the same command with ``demo.num_steps=3``: resumes from that checkpoint (loads it) and runs step 3 only;
3. TP2 as two single-process "nodes" (two torchrun invocations on localhost, ``NNODES=2``, ``NODE_RANK=0/1``).

On CUDA (``gpu``): ``configs/demo_gpu.yaml`` on one GPU for a few steps, then a resume. Without CUDA, a launch
that asks for more ranks than GPUs cannot be provoked: ``test_too_many_ranks_for_the_gpus_stops_early`` fakes
the GPU count through ``PY``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.multirank import free_port

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[2]
FAST = ["demo.baseline_episodes=200", "logging.progress_bar=false", "checkpoint.save_interval=1",
        "parallel.device=cpu"]


def setup_is_offline() -> bool:
    """``scripts/setup.sh`` is a quick no-op when the venv it names exists; otherwise it needs the registry
    (e.g. on a lent GPU machine that has neither), and the README-form launch runs with ``PY`` instead. The
    README form is also skipped when that venv is not the one running the tests (e.g. pytest started from
    ``.venv-py3.11`` without ``PYTHON=``): both launches of a test must use one megatron-core version."""
    venv = subprocess.run(["bash", "scripts/setup.sh", "--venv"], cwd=ROOT, capture_output=True, text=True)
    path = ROOT / venv.stdout.strip()
    return (venv.returncode == 0 and (path / "bin" / "python").exists()
            and path.resolve() == Path(sys.prefix).resolve())


def launch(env_extra: dict[str, str], overrides: list[str], *, readme_form: bool = False) -> subprocess.Popen:
    """``bash run_megatron.sh <overrides>``; ``readme_form``: exactly the README's command line, overrides added."""
    env = {**os.environ, **env_extra}
    if readme_form and setup_is_offline():
        command = ["bash", "-c", 'bash scripts/setup.sh && bash run_megatron.sh "$@"', "main-job", *overrides]
    else:
        env["PY"] = sys.executable
        command = ["bash", str(ROOT / "run_megatron.sh"), *overrides]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"run_megatron.sh timed out:\n{out[-4000:]}") from None
    assert proc.returncode == 0, f"run_megatron.sh exited {proc.returncode}:\n{out[-6000:]}"
    return out


def metrics_rows(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def check_run(output_dir: Path, steps: int) -> list[dict]:
    rows = metrics_rows(output_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        for key in ("reward/mean", "policy/loss", "optim/grad_norm", "rollout/logprob_abs_diff_max"):
            assert key in row and math.isfinite(row[key]), (key, row)
        assert row["optim/steps"] == 8  # 8 games per step / 2 per mini-batch x 2 epochs
        assert row["rollout/logprob_abs_diff_max"] < 1e-4  # the sampler and the trainer agree
    for name in ("config.yaml", "reward_loss.png", "summary.txt"):
        assert (output_dir / name).is_file(), name
    assert any((output_dir / "tensorboard").iterdir())
    assert (output_dir / "checkpoints" / f"step_{steps:08d}").is_dir()
    assert (output_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps:08d}"
    return rows


def test_run_megatron_dp2_then_resume(tmp_path: Path) -> None:
    out_dir, tmp = tmp_path / "dp2", tmp_path / "tmp"
    tmp.mkdir()  # the launches' temporary folder: torchrun's own (torchelastic_*) and the ranks'
    env = {"NPROC": "2", "MASTER_PORT": str(free_port()), "TMPDIR": str(tmp)}
    common = [*FAST, f"logging.output_dir={out_dir}"]
    out = finish(launch(env, [*common, "demo.num_steps=2"], readme_form=True))
    assert "outputs in" in out and "random policy" in out
    lines = out.splitlines()
    launcher = next(i for i, line in enumerate(lines) if line.startswith("run_megatron.sh:"))
    assert f"outputs go to {out_dir} (logging.output_dir)" in lines[launcher + 1]  # the config used, not the default
    first = check_run(out_dir, 2)
    assert "random policy" in (out_dir / "summary.txt").read_text()

    env["MASTER_PORT"] = str(free_port())
    out = finish(launch(env, [*common, "demo.num_steps=3"]))
    assert "resuming after step 2" in out
    from megatron_rl.warnings_filter import MEGATRON_CORE_CALL_WARNINGS

    assert not [text for _, text in MEGATRON_CORE_CALL_WARNINGS if text in out], out  # a quiet resume
    rows = check_run(out_dir, 3)
    assert rows[:2] == first  # steps 1-2 are not re-run; step 3 continues from the loaded checkpoint

    # the same command once more, with another layout: the run is finished, one line says so, nothing rewritten
    written = {p: p.read_bytes() for p in out_dir.rglob("*") if p.is_file()}
    env["MASTER_PORT"] = str(free_port())
    out = finish(launch(env, [*common, "demo.num_steps=3", "parallel.context_parallel_size=2"]))
    assert len([line for line in out.splitlines() if "finished at step 3" in line]) == 1, out
    assert "job.num_steps=6" in out and "Traceback" not in out
    assert {p: p.read_bytes() for p in out_dir.rglob("*") if p.is_file()} == written  # config.yaml still DP2
    # three finished launches leave nothing in the temporary folder (torch's compile cache, one per user, is
    # reused by the next run, not left by this one); launch.py: torchrun's folders, torchelastic_* before
    assert [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")] == []


def test_two_node_launch_tp2(tmp_path: Path) -> None:
    out_dir = tmp_path / "tp2"
    port = str(free_port())
    overrides = [*FAST, f"logging.output_dir={out_dir}", "demo.num_steps=2", "parallel.tensor_model_parallel_size=2"]
    nodes = [
        launch({"NPROC": "1", "NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port}, overrides)
        for rank in (0, 1)
    ]
    outputs = [finish(proc) for proc in nodes]
    assert "TP2 PP1 DP1" in outputs[0]
    check_run(out_dir, 2)


@pytest.mark.parametrize("path, world_size", [("configs/demo_cpu.yaml", 2), ("configs/demo_gpu_qwen3_0p6b.yaml", 4),
                                              ("configs/demo_gpu.yaml", 1)])
def test_shipped_configs_load_and_fit_the_demo(path: str, world_size: int) -> None:
    from megatron_rl.job.config import check_demo_config, load_job_config
    from megatron_rl.environments.next_digit.tokenizer import DigitTokenizer

    config = load_job_config(ROOT / path)
    config.rl.parallel.check_world_size(world_size)
    check_demo_config(config.rl, DigitTokenizer())


def test_demo_config_errors_name_the_key() -> None:
    from megatron_rl.config import load_config
    from megatron_rl.job.config import check_demo_config
    from megatron_rl.environments.next_digit.tokenizer import DigitTokenizer

    with pytest.raises(ValueError, match="model.vocab_size=128"):
        check_demo_config(load_config(None), DigitTokenizer())


def test_too_many_ranks_for_the_gpus_stops_early(tmp_path: Path, monkeypatch, capsys) -> None:
    """``NPROC`` above the visible GPU count stops before torchrun with what to do (never a raw NCCL error): the
    launcher's check (``job/start.py: ranks_device``, on the device of the config the pre-flight resolved)."""
    import torch

    from megatron_rl.job.start import ranks_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert ranks_device("auto", 2) == 2
    err = capsys.readouterr().err
    assert "NPROC=2 ranks but 1 visible CUDA GPU(s)" in err and "parallel.device=cpu" in err
    assert ranks_device("auto", 1) == 0
    env = {**os.environ, "NPROC": "2", "CONFIG": "configs/demo_gpu.yaml"}
    env["PY"] = "no-such-python"
    proc = subprocess.run(["bash", str(ROOT / "run_megatron.sh")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "PY=python3" in proc.stdout


@pytest.mark.gpu
def test_main_job_on_one_gpu_then_resume(tmp_path: Path) -> None:
    out_dir = tmp_path / "gpu"
    env = {"NPROC": "1", "CONFIG": "configs/demo_gpu.yaml", "MASTER_PORT": str(free_port())}
    common = ["demo.baseline_episodes=200", "logging.progress_bar=false", "checkpoint.save_interval=1",
              f"logging.output_dir={out_dir}"]
    out = finish(launch(env, [*common, "demo.num_steps=3"]))
    assert "TP1 PP1 DP1" in out
    first = metrics_rows(out_dir)
    assert [r["step"] for r in first] == [1, 2, 3]
    env["MASTER_PORT"] = str(free_port())
    out = finish(launch(env, [*common, "demo.num_steps=4"]))
    assert "resuming after step 3" in out
    rows = metrics_rows(out_dir)
    assert rows[:3] == first and [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert all(math.isfinite(row[k]) for k in ("reward/mean", "policy/loss", "optim/grad_norm")), row
