"""``environments/registry.py``: names and class specs, a duplicate name refused, and no import of the job."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.environments import registry

ROOT = Path(__file__).resolve().parents[2]


def test_a_duplicate_name_is_a_value_error():
    builder = registry.ENVIRONMENTS["single_turn"]
    with pytest.raises(ValueError, match="'single_turn' is already registered"):
        registry.register_environment("single_turn", lambda config: None)
    assert registry.ENVIRONMENTS["single_turn"] is builder
    with pytest.raises(ValueError, match="has a ':'"):
        registry.register_environment("my.module:Env", lambda config: None)


def test_unknown_name_lists_the_known_ones():
    class Config:
        environment = "nope"

    known = r"\['agent', 'next_digit', 'single_turn'\]"
    with pytest.raises(ConfigError, match=rf"'nope' is not one of {known} nor a step-API"):
        registry.make_environment(Config())


def test_environments_never_import_the_job():
    """Environments are plug-ins of the job (the former registry <-> job/config.py import cycle)."""
    for path in (ROOT / "megatron_rl" / "environments").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("megatron_rl.job") for n in names), f"{path} imports {names}"
