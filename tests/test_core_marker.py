"""The ``core`` list of tests/support/ends.py (what the oldest end of the megatron-core range runs, docs/TESTING.md)
names only files, folders and tests that exist: a rename would otherwise drop a test from the oldest end silently."""

from __future__ import annotations

import re

from tests.support.ends import CORE, ROOT


def test_every_core_entry_exists():
    for entry in CORE:
        path, _, test = entry.partition("::")
        target = ROOT / path
        assert target.exists(), f"tests/support/ends.py CORE names {entry!r}: no such file or folder"
        if test:
            test = test.partition("[")[0]  # one parameter set: the test function must exist
            assert re.search(rf"^def {re.escape(test)}\(", target.read_text(), re.M), (
                f"tests/support/ends.py CORE names {entry!r}: no such test in {path}")
