"""``launch.scheduler=ray`` without a cluster: the ranks' torchrun variables and GPUs (``launch/ray_layout.py``),
the ``launch.ray`` keys' errors, ``plan.py``'s line, a missing ``ray`` (one line) and the local launch never
importing ``ray``. Pure and fast (the cluster tests: ``test_ray.py``)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from megatron_rl.config_files import ConfigError
from megatron_rl.job.launch_config import LaunchConfig, launch_config_from_flat, launch_keys
from megatron_rl.job.ray_launch_config import RAY_VERSION, RayConfig
from megatron_rl.launch import plan
from megatron_rl.launch.ray_driver import connect
from megatron_rl.launch.ray_layout import Layout, RayLaunchError, gpus_per_rank, layout_from, visible_devices


def test_rank_env_is_torchruns_order() -> None:
    """Rank r is local rank r % NPROC of node r // NPROC, as torchrun numbers them (4 ranks on 2 nodes)."""
    layout = Layout(nodes=2, nproc=2, cpus_per_rank=1, gpus_per_rank=1)
    envs = [layout.rank_env(rank, "10.0.0.1", 29500, "0,1") for rank in range(4)]
    assert [(e["RANK"], e["GROUP_RANK"], e["LOCAL_RANK"]) for e in envs] == [
        ("0", "0", "0"), ("1", "0", "1"), ("2", "1", "0"), ("3", "1", "1")]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"])
            for e in envs} == {("4", "2", "2", "10.0.0.1", "29500")}
    assert layout.bundles() == [{"CPU": 2, "GPU": 2}] * 2 and layout.strategy == "STRICT_SPREAD"
    cpu = Layout(nodes=1, nproc=2, cpus_per_rank=0.5, gpus_per_rank=0)
    assert cpu.bundles() == [{"CPU": 1.0}] and cpu.strategy == "PACK"


def test_visible_devices_are_the_nodes_ranks_gpus_in_local_rank_order() -> None:
    """Each rank sees its node's GPUs, its own at index LOCAL_RANK (Ray gave rank 2 GPU 3, rank 3 GPU 1)."""
    layout = Layout(nodes=2, nproc=2, cpus_per_rank=1, gpus_per_rank=1)
    places = [{"gpus": ["0"]}, {"gpus": ["1"]}, {"gpus": ["3"]}, {"gpus": ["1"]}]
    assert [visible_devices(places, layout, node) for node in (0, 1)] == ["0,1", "3,1"]


def test_nodes_ranks_and_gpus_from_the_config_and_environment() -> None:
    launch = LaunchConfig(scheduler="ray", nodes=3)
    assert layout_from(launch, {"NPROC": "4"}, 1) == Layout(nodes=3, nproc=4, cpus_per_rank=1, gpus_per_rank=1)
    assert layout_from(LaunchConfig(scheduler="ray"), {"NNODES": "2"}, 0).nodes == 2
    with pytest.raises(RayLaunchError, match="launch.nodes=3 but NNODES=2"):
        layout_from(launch, {"NNODES": "2"}, 0)
    with pytest.raises(RayLaunchError, match="NPROC='x'"):
        layout_from(launch, {"NPROC": "x"}, 0)
    assert [gpus_per_rank(LaunchConfig(), device, gpus) for device, gpus in
            (("cpu", 8), ("auto", 8), ("auto", 0), ("cuda", 2))] == [0, 1, 0, 1]
    assert gpus_per_rank(LaunchConfig(ray=RayConfig(gpus_per_rank=0.5)), "cpu", 0) == 0.5
    with pytest.raises(RayLaunchError, match="parallel.device=cuda but the Ray cluster has no GPU"):
        gpus_per_rank(LaunchConfig(), "cuda", 0)


VLLM = {"rollout.engine": "vllm", "rollout.num_engines": 3}


def test_engine_nodes_are_bundles_of_their_own_after_the_trainers() -> None:
    """rollout.engine_nodes=2 of launch.nodes=4: 2 trainer nodes (the world), then one bundle per engine node with
    its engines' CPUs and GPUs (engine i on engine node i % 2: two, then one), and the engine nodes' resource."""
    launch = launch_config_from_flat({"launch.nodes": 4, "launch.ray.cpus_per_engine": 2,
                                      "launch.ray.engine_node_resource": "inference"})
    layout = layout_from(launch, {"NPROC": "2"}, 1, {**VLLM, "rollout.engine_nodes": 2,
                                                     "rollout.engine_tensor_parallel_size": 2})
    assert (layout.nodes, layout.world, layout.all_nodes, layout.strategy) == (2, 4, 4, "STRICT_SPREAD")
    assert layout.bundles() == [{"CPU": 2, "GPU": 2}] * 2 + [
        {"CPU": 4, "GPU": 4, "inference": 0.001}, {"CPU": 2, "GPU": 2, "inference": 0.001}]
    cpu = layout_from(LaunchConfig(nodes=2), {"NPROC": "1"}, 0, {**VLLM, "rollout.engine_nodes": 1})
    assert cpu.bundles() == [{"CPU": 1}, {"CPU": 3}] and cpu.world == 1  # CPU ranks: no GPU for the engines
    with pytest.raises(RayLaunchError, match="rollout.engine_nodes=2 but the job has 2 node"):
        layout_from(LaunchConfig(nodes=2), {}, 0, {**VLLM, "rollout.engine_nodes": 2})


def test_engines_beside_the_trainer_have_their_cpus_in_its_bundles() -> None:
    """No engine nodes: engine i runs on trainer node i % nodes (inference/nodes.py), its CPUs in that bundle;
    the built-in engine (no process) reserves nothing."""
    layout = layout_from(LaunchConfig(nodes=2), {"NPROC": "2"}, 0, VLLM)
    assert layout.bundles() == [{"CPU": 4}, {"CPU": 3}] and layout.engine_bundles == ()
    assert layout_from(LaunchConfig(nodes=2), {"NPROC": "2"}, 0, {}).bundles() == [{"CPU": 2}] * 2


@pytest.mark.parametrize(("key", "value", "message"), [
    ("launch.ray.cpus_per_rank", 0, "must be a number > 0"),
    ("launch.ray.gpus_per_rank", -1, "must be a number >= 0"),
    ("launch.ray.placement_timeout_s", "soon", "must be a number > 0"),
    ("launch.ray.address", "", "must be a Ray address"),
    ("launch.ray.cpus_per_engine", 0, "must be a number > 0"),
    ("launch.ray.gpus_per_engine", -1, "must be a number >= 0"),
    ("launch.ray.engine_node_resource", " ", "must be the name of a custom resource"),
    ("launch.scheduler", "kubernetes", "is not one of ['local', 'slurm', 'ray']"),
    ("launch.ray.adress", "auto", "unknown config key 'launch.ray.adress'"),
])
def test_launch_ray_errors_name_the_key(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        launch_config_from_flat({key: value})
    assert "launch.ray.address" in launch_keys() and "launch.slurm.time" in launch_keys()


def test_plan_runs_the_ray_driver_also_inside_an_allocation() -> None:
    """launch.scheduler=ray: the driver, with NPROC exported; in a Slurm allocation too (a Ray cluster on Slurm)."""
    argv = ["--config", "a.yaml", "launch.scheduler=ray"]
    for env in ({}, {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"}):
        lines = plan.plan(env, LaunchConfig(scheduler="ray"), argv)
        assert lines[0] == "export NPROC"
        assert lines[1].startswith("exec ") and "-m megatron_rl.launch.ray_driver --config a.yaml" in lines[1]


def test_missing_ray_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as without the package
    with pytest.raises(RayLaunchError) as err:
        connect(None)
    assert str(err.value).startswith("run_megatron.sh: launch.scheduler=ray needs the ray package, not installed in ")
    assert f"pip install 'ray=={RAY_VERSION}'" in str(err.value) and "\n" not in str(err.value)


def test_the_local_launch_never_imports_ray() -> None:
    """plan.py (every launch runs it) and the job's config (every rank loads it) leave ``ray`` unimported."""
    code = ("import sys; from megatron_rl.launch import plan; from megatron_rl.job.config import JobConfig; "
            "plan.main(['launch.nodes=1']); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "False"
    assert RAY_VERSION in open(plan.LAUNCHER.parent / "setup.py").read()  # the extra pins the version named here


def test_no_cluster_at_the_address_is_one_line() -> None:
    """A dead ``host:port`` is one line at once (``ray.init`` alone would retry it for minutes)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens once closed
    with pytest.raises(RayLaunchError) as err:
        connect(f"127.0.0.1:{port}")
    assert str(err.value).startswith(f"run_megatron.sh: launch.scheduler=ray: no Ray cluster at 127.0.0.1:{port} "
                                     "(Connection refused); start one (ray start --head) or set RAY_ADDRESS")
