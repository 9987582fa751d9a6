"""W36 (megatron_rl/lazy_compile.py): megatron-core's import-time ``torch.compile`` is deferred to the first call.

Without it, ``import megatron.core`` imports TorchDynamo (the second case shows that the cost is real, so the
first would fail if the finder were not installed); with it, nothing of TorchDynamo is imported until a fused
function runs, and that function then compiles with the arguments megatron gave and computes what it did.
"""

import subprocess
import sys

import pytest

CHECK = """
import sys
{first}
import torch, megatron.core, megatron.core.models.gpt
from megatron.core.fusions.fused_bias_geglu import geglu
print("dynamo_at_import", "torch._dynamo" in sys.modules)
y = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
a, b = torch.chunk(y, 2, -1)
expected = a * 0.5 * (1.0 + torch.tanh(0.79788456 * a * (1 + 0.044715 * a * a))) * b
print("equal", torch.allclose(geglu(y), expected, rtol=1e-6, atol=1e-6))
print("compile_restored", torch.compile.__module__ == "torch")
"""


@pytest.mark.slow
@pytest.mark.parametrize("first, dynamo_at_import", [("import megatron_rl", False), ("", True)],
                         ids=["with_megatron_rl", "megatron_core_alone"])
def test_megatron_core_import_does_not_import_dynamo(first, dynamo_at_import):
    done = subprocess.run([sys.executable, "-c", CHECK.format(first=first)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines["dynamo_at_import"] == str(dynamo_at_import)
    assert lines["equal"] == "True" and lines["compile_restored"] == "True"


def test_lazy_compile_passes_megatrons_arguments_at_the_first_call():
    from megatron_rl import lazy_compile

    calls = []

    def real(fn, **options):
        calls.append(options)
        return lambda *args: ("compiled", fn(*args))

    saved = lazy_compile._state["real"]
    lazy_compile._state["real"] = real
    try:
        decorated = lazy_compile.lazy_compile(mode="max-autotune")(lambda x: x + 1)
        assert calls == []
        assert decorated(1) == ("compiled", 2) and decorated(2) == ("compiled", 3)
        assert calls == [{"mode": "max-autotune"}]
    finally:
        lazy_compile._state["real"] = saved
