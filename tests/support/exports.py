"""Checks on an exported Hugging Face checkpoint, shared by the HF export tests."""

from __future__ import annotations

from pathlib import Path

import torch


def assert_same_weights(source_dir: Path, exported_dir: Path, label) -> dict[str, torch.Tensor]:
    """The export's ``model.safetensors`` holds the source's tensors, bitwise, under the same names; returns the
    source's tensors. ``label`` goes into each failure message."""
    from safetensors.torch import load_file

    source, exported = load_file(source_dir / "model.safetensors"), load_file(exported_dir / "model.safetensors")
    assert sorted(source) == sorted(exported), label
    for name in source:
        assert torch.equal(source[name], exported[name]), (label, name)
    return source
