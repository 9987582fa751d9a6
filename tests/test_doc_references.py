"""Every repository file that the README, BENCHMARKS, docs, configs or docstrings name exists (a rename or a
file never written leaves a stale reference behind)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(
    r"(?<![\w/.-])((?:tests|megatron_rl|bench|configs|examples|scripts|docs|patches)/[\w./-]+?"
    r"\.(?:py|md|yaml|sh|jsonl|json))(?![\w])"
)


def cited_paths() -> dict[str, set[str]]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    cited: dict[str, set[str]] = {}
    for name in files:
        if not name.endswith((".py", ".md", ".yaml", ".sh")) or name == "tests/test_doc_references.py":
            continue
        for match in CITED.finditer((ROOT / name).read_text(errors="replace")):
            cited.setdefault(match.group(1), set()).add(name)
    return cited


def test_every_cited_file_exists():
    missing = {path: sorted(by) for path, by in cited_paths().items() if not (ROOT / path).exists()}
    assert not missing, f"cited but not in the repository: {missing}"


def test_a_stale_reference_is_caught(tmp_path):
    assert CITED.findall("see tests/cp/test_cp_grads.py and examples/arithmetic/train.jsonl") == [
        "tests/cp/test_cp_grads.py", "examples/arithmetic/train.jsonl"]
    assert not (ROOT / "tests/cp/test_cp_grads.py").exists()
