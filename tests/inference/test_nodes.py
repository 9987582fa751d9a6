"""Which node starts which engine, and the address a node's engines bind to (``megatron_rl/inference/nodes.py``)."""

from __future__ import annotations

import socket

import pytest

from megatron_rl.inference.nodes import LOOPBACK, NodeLayout, engine_host, engine_node, engines_on_node


@pytest.mark.parametrize("num_engines,nnodes", [(1, 1), (2, 1), (2, 2), (5, 2), (3, 4), (8, 3)])
def test_every_engine_runs_on_exactly_one_node_round_robin(num_engines, nnodes):
    shares = [engines_on_node(num_engines, node, nnodes) for node in range(nnodes)]
    assert sorted(i for share in shares for i in share) == list(range(num_engines))
    for node, share in enumerate(shares):
        assert all(engine_node(i, nnodes) == node for i in share)
        assert share == sorted(share)
    sizes = [len(share) for share in shares]
    assert max(sizes) - min(sizes) <= 1  # balanced
    assert engines_on_node(num_engines, 0, 1) == list(range(num_engines))  # one node: all, as before


def test_layout_from_torchrun_environment(monkeypatch):
    for key, value in {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "RANK": "5", "LOCAL_RANK": "1",
                       "GROUP_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    assert NodeLayout.from_env() == NodeLayout(node=1, nnodes=2, local_rank=1)
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert NodeLayout.from_env().owner
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK"):  # not torchrun: one node
        monkeypatch.delenv(key)
    assert NodeLayout.from_env() == NodeLayout(node=0, nnodes=1, local_rank=4)


def test_single_node_binds_loopback_whatever_the_setting():
    assert engine_host("auto", 1) == LOOPBACK
    assert engine_host("10.1.2.3", 1) == LOOPBACK


def test_multi_node_binds_the_interface_that_routes_to_the_master():
    assert engine_host("10.1.2.3", 2) == "10.1.2.3"
    assert engine_host("auto", 2, master_addr="127.0.0.1") == "127.0.0.1"  # loopback routes via loopback
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:  # the reference: the kernel's own route choice
        try:
            sock.connect(("192.0.2.1", 9))  # TEST-NET-1: routed (by the default route) but never reached
        except OSError:
            pytest.skip("no default route on this machine")
        expected = sock.getsockname()[0]
    assert engine_host("auto", 2, master_addr="192.0.2.1") == expected


def test_an_unroutable_master_names_the_key():
    with pytest.raises(ValueError, match="rollout.engine_host"):
        engine_host("auto", 2, master_addr="no-such-host.invalid")


@pytest.mark.parametrize("num_engines,nnodes,engine_nodes", [(1, 1, 1), (2, 1, 1), (4, 2, 2), (5, 3, 2), (8, 1, 3)])
def test_engine_nodes_take_every_engine_and_the_trainer_nodes_none(num_engines, nnodes, engine_nodes):
    """``rollout.engine_nodes``: engine i on node ``nnodes + i % engine_nodes``, after the trainer's nodes."""
    shares = {node: engines_on_node(num_engines, node, nnodes, engine_nodes) for node in range(nnodes + engine_nodes)}
    assert all(shares[node] == [] for node in range(nnodes))  # no engine beside a trainer rank
    assert sorted(i for share in shares.values() for i in share) == list(range(num_engines))
    sizes = [len(shares[node]) for node in range(nnodes, nnodes + engine_nodes)]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1  # balanced, each engine node used
    assert [engine_node(i, nnodes, engine_nodes) for i in range(engine_nodes)] == list(range(nnodes, nnodes + engine_nodes))


def test_engine_nodes_errors_name_the_key():
    from megatron_rl.config import ConfigError
    from megatron_rl.inference.config import RolloutConfig
    from megatron_rl.inference.nodes import check_engine_nodes

    with pytest.raises(ValueError, match=r"rollout.engine_nodes=2 but the job has 2 node\(s\)"):
        check_engine_nodes(2, 4, all_nodes=2)
    from megatron_rl.inference.registry import check_engine_config

    with pytest.raises(ConfigError, match=r"rollout.engine_nodes=2 .*rollout.engine=builtin .*\['vllm'\]"):
        check_engine_config(RolloutConfig(engine="builtin", num_engines=2, engine_nodes=2), None, "cpu")  # by its capabilities
    for kwargs, words in [({"engine": "vllm", "num_engines": 1}, "rollout.num_engines >= 2"),
                          ({"engine": "vllm", "num_engines": 2, "sleep_while_training": True}, "sleep_while_training")]:
        with pytest.raises(ConfigError, match="rollout.engine_nodes=2") as err:
            RolloutConfig(engine_nodes=2, **kwargs).validate()
        assert words in str(err.value)
    RolloutConfig(engine="vllm", num_engines=2, engine_nodes=2).validate()


def test_a_node_count_engine_nodes_cannot_fit_stops_in_one_line(tmp_path, capsys):
    """``run_megatron.sh`` before anything starts (~2 s: the config files' one Python call); the engine host too."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from megatron_rl.inference.vllm.engine_host import main

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PY": sys.executable, "NNODES": "2", "NODE_RANK": "1", "CONFIG": "configs/demo_vllm.yaml"}
    proc = subprocess.run(["bash", str(root / "run_megatron.sh"), "rollout.engine_nodes=2",
                           f"logging.output_dir={tmp_path}"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "rollout.engine_nodes=2 but the job has 2 node(s) (NNODES)" in proc.stderr, proc
    assert main(["--nodes", "2", "--engine-nodes", "1", "--node-rank", "0"]) == 2
    assert "NODE_RANK=0 is not one of the 1 engine node(s) 1..1" in capsys.readouterr().err
