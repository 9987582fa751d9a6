"""Pure tests of what the launch derives from Slurm's variables (``launch/slurm_env.py``, ``launch/plan.py``), the
``launch`` config section's errors (``job/launch_config.py``) and the batch script (``launch/batch_script.py``).
No cluster, ~0.1 s. The variables are the ones a real srun step sets (checked on the test cluster: a step of 2
nodes gives SLURM_NNODES=2, SLURM_NODEID=0/1, SLURM_STEP_NUM_TASKS=2)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from megatron_rl.config_files import ConfigError
from megatron_rl.job.launch_config import LaunchConfig, SlurmConfig, launch_config_from_flat
from megatron_rl.launch import batch_script, plan, slurm_env

STEP = {"SLURM_JOB_ID": "41", "SLURM_NNODES": "4", "SLURM_JOB_NUM_NODES": "4", "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_JOB_NODELIST": "gpu[01-04]", slurm_env.STEP_ENV: "1"}


def exported(lines: list[str]) -> dict[str, str]:
    """The variables ``export A=1 B=2`` lines set."""
    out = {}
    for line in lines:
        words = shlex.split(line)
        assert words[0] == "export", line
        out.update(word.split("=", 1) for word in words[1:])
    return out


@pytest.mark.parametrize("node_id", ["0", "1", "3"])
def test_node_rank_and_count_come_from_slurm(node_id: str) -> None:
    env = {**STEP, "SLURM_NODEID": node_id, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    assert exported(plan.plan(env, LaunchConfig(), [])) == {"NNODES": "4", "NODE_RANK": node_id}
    assert slurm_env.node_place(env) == slurm_env.NodePlace(nnodes=4, node_rank=int(node_id))


def test_gpus_per_node_from_slurm_unless_nproc_is_set() -> None:
    env = {**STEP, "SLURM_NODEID": "2", "SLURM_GPUS_ON_NODE": "8"}
    assert exported(plan.plan(env, LaunchConfig(), []))["NPROC"] == "8"
    assert "NPROC" not in exported(plan.plan({**env, "NPROC": "4"}, LaunchConfig(), []))
    assert slurm_env.gpus_per_node({"SLURM_GPUS_ON_NODE": "0"}) is None


def test_rendezvous_port_is_the_same_on_every_node_and_master_port_wins() -> None:
    assert slurm_env.master_port({"SLURM_JOB_ID": "41"}) == slurm_env.PORT_BASE + 41
    assert slurm_env.master_port({"SLURM_JOB_ID": "20041"}) == slurm_env.PORT_BASE + 41
    assert slurm_env.master_port({"SLURM_JOB_ID": "41", "MASTER_PORT": "1234"}) == 1234


def test_contradictions_are_one_line_each() -> None:
    alloc = slurm_env.allocation({"SLURM_JOB_ID": "7", "SLURM_NNODES": "2"})
    assert alloc.nnodes == 2
    slurm_env.check_nodes(alloc, 2, {"NNODES": "2"})
    with pytest.raises(slurm_env.SlurmContradiction, match=r"^launch.nodes=4 but this Slurm allocation \(job 7\)"):
        slurm_env.check_nodes(alloc, 4, {})
    with pytest.raises(slurm_env.SlurmContradiction, match=r"^NNODES=3 but this Slurm allocation"):
        slurm_env.check_nodes(alloc, None, {"NNODES": "3"})
    with pytest.raises(slurm_env.SlurmContradiction, match="one task per node"):
        slurm_env.node_place({**STEP, "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "8"})
    with pytest.raises(slurm_env.SlurmContradiction, match="launch.nodes=2 but NNODES=3"):
        plan.plan({"NNODES": "3"}, LaunchConfig(nodes=2), [])


def test_outside_slurm_the_launch_is_local_or_a_submission() -> None:
    assert plan.plan({}, LaunchConfig(), ["--config", "a.yaml", "x.y=1"]) == []
    assert exported(plan.plan({}, LaunchConfig(nodes=2), [])) == {"NNODES": "2"}
    line = plan.plan({}, LaunchConfig(scheduler="slurm"), ["--config", "a.yaml", "x.y=1"])
    assert shlex.split(line[0])[2:] == ["-m", "megatron_rl.launch.submit", "--config", "a.yaml", "x.y=1"]


@pytest.mark.parametrize("key, value, message", [
    ("launch.scheduler", "k8s", "launch.scheduler='k8s' is not one of"),
    ("launch.nodes", 0, "launch.nodes=0 must be an integer >= 1"),
    ("launch.slurm.time", "soon", "launch.slurm.time='soon' is not a Slurm time limit"),
    ("launch.slurm.extra", "--qos=x", "launch.slurm.extra='--qos=x' must be a list"),
    ("launch.slurm.gpus_per_node", 0, "launch.slurm.gpus_per_node=0"),
    ("launch.slurm.requeue", "yes", "launch.slurm.requeue='yes' must be true or false"),
    ("launch.slurm.partitoin", "a", "unknown config key 'launch.slurm.partitoin'"),
])
def test_bad_launch_values_name_the_key(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        launch_config_from_flat({key: value})


def test_the_job_config_accepts_the_section() -> None:
    from megatron_rl.job.config import load_job_config

    config = load_job_config("configs/demo_cpu.yaml", ["launch.scheduler=slurm", "launch.slurm.time=0-01:00:00"])
    assert config.launch.scheduler == "slurm" and config.to_dict()["launch"]["slurm"]["time"] == "0-01:00:00"
    with pytest.raises(ValueError, match="launch.slurm.time=3600 was read as a number .* launch.slurm.time=0-04:00:00"):
        load_job_config("configs/demo_cpu.yaml", ["launch.slurm.time=1:00:00"])
    with pytest.raises(ValueError, match="launch.nodes"):
        load_job_config("configs/demo_cpu.yaml", ["launch.nodes=-1"])


def test_batch_script_says_everything(tmp_path: Path) -> None:
    slurm = SlurmConfig(partition="gpu", time="2:00:00", gpus_per_node=8, extra=["#SBATCH --qos=high"], requeue=True,
                        signal_s=300)
    job = batch_script.BatchJob(nodes=4, slurm=slurm, output_dir=tmp_path, workdir=Path("/home/me"),
                                launcher=Path("/repo/run_megatron.sh"), args=("a.b=1 2",), env=(("NPROC", "8"),))
    text = batch_script.render(job)
    sbatch = [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == ["--job-name=megatron_rl", "--nodes=4", "--ntasks-per-node=1",
                      f"--output={tmp_path}/slurm-%j.log", "--open-mode=append", "--partition=gpu", "--time=2:00:00",
                      "--gpus-per-node=8", "--requeue", "--signal=B:USR1@300", "--qos=high"]
    assert "bash /repo/run_megatron.sh 'a.b=1 2' &" in text and "export NPROC=8" in text
    assert 'if [ "$code" = 3 ]' in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "kill -USR1 $pid" in text and "kill -TERM $pid" in text
    assert f"export MEGATRON_RL_COMMAND='sbatch {tmp_path}/slurm_job.sh'" in text
