"""The CPU patches let megatron-core's own schedule, DDP, finalize and optimizer code run, with exact results.

One 2-rank PP2 run (tied embeddings, packed micro-batches of different lengths) drives
``get_forward_backward_func`` + megatron ``DistributedDataParallel`` + ``finalize_model_grads`` +
``get_megatron_optimizer(...).step()`` with grad clipping on (its CUDA call sites: P1-P5), spying on
megatron's functions to show they really ran; losses, the grad norm and the parameters after one SGD step
are compared with a plain single-process autograd reference built from the same full state dict.

The patches exist for CUDA-less machines (P12 also for GPU machines without fla): tests that need them applied
skip where CUDA is available.
Which patches apply depends on the installed megatron-core (``EXPECTED_PATCHES``, the version table of
docs/MEGATRON_CORE.md).
"""

import importlib.metadata
import logging
import re
from pathlib import Path

import pytest
import torch

from megatron_rl.config import ModelConfig, ParallelConfig
from megatron_rl.data.packing import pack
from megatron_rl.distributed.bootstrap import destroy_distributed, initialize_distributed
from megatron_rl.model.builder import build_gpt_model
from megatron_rl.model.logprobs import vocab_parallel_logprobs_entropy
from megatron_rl.model.weights import full_state_dict, load_full_state_dict
from tests.support.multirank import run_ranks

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    vocab_size=64, share_embeddings_and_output_weights=True, attention_backend="local")
NUM_MICROBATCHES = 2
LR = 0.5
_MOE = ["P10 MoE dispatcher side stream", "P11 MoE split sizes on the host"]
_COMMON = ["P1 device='cuda' in megatron-core factories", "P2 torch.cuda.current_device",
           "P3 torch.cuda.synchronize", "P9 torch.cuda.current_stream", "P4 Tensor.cuda", "P5 Tensor.type",
           "P6 CPU RNG tracker", *_MOE]
EXPECTED_PATCHES = {  # megatron-core version -> the patches applied on CPU, in order
    "0.16.1": _COMMON,
    "0.19.2": [*_COMMON, "P12 fla stand-ins for Gated-DeltaNet"],
}
MCORE_VERSION = importlib.metadata.version("megatron-core")
needs_cpu_patches = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CUDA is available: the CPU patches are not applied (nothing to test)")


def _micro_batches():
    gen = torch.Generator().manual_seed(0)
    out = []
    for lengths in ([5, 2, 9], [3, 11]):  # different packed totals per micro-batch
        ids = torch.randint(1, MODEL.vocab_size, (len(lengths), 11), generator=gen)
        mask = torch.zeros_like(ids)
        for i, n in enumerate(lengths):
            mask[i, 11 - n :] = 1
        out.append(pack(ids, mask, align=1))
    return out


def _summed_nll(logits, packed):
    logprobs, _ = vocab_parallel_logprobs_entropy(logits, packed.labels, None, False)
    return -(logprobs * packed.label_mask).sum()


def _spy(owner, name: str, counts: dict) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def _pp2_train_step(rank, world_size, full_sd, micro_batches):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    from megatron_rl import patches

    parallel = ParallelConfig(pipeline_model_parallel_size=2)
    groups = initialize_distributed(parallel, seed=3)
    counts: dict[str, int] = {}
    _spy(torch.cuda, "current_device", counts)  # P2 replacement, called from DDP buffers and p2p buffers
    _spy(schedules, "forward_backward_pipelining_without_interleaving", counts)
    _spy(p2p_communication.P2PCommunicator, "_communicate", counts)
    _spy(DistributedDataParallel, "finish_grad_sync", counts)

    model = build_gpt_model(MODEL, parallel, groups)
    load_full_state_dict(model, full_sd, groups)
    ddp_model = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model,
                                        pg_collection=groups.pg_collection)

    def finalize(*args, **kwargs):
        counts["finalize_model_grads"] = counts.get("finalize_model_grads", 0) + 1
        return finalize_model_grads(*args, **kwargs)

    model.config.finalize_model_grads_func = finalize
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=0.0, weight_decay=0.0, clip_grad=1e6), [ddp_model])

    def forward_step(data_iterator, chunk):
        packed = next(data_iterator)
        output = chunk(packed.input_ids, packed.position_ids, None, packed_seq_params=packed.packed_seq_params())

        def loss_func(logits):
            loss = _summed_nll(logits, packed)
            return loss, {"loss": loss.detach().clone()}

        return output, loss_func

    losses = schedules.get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[ddp_model],
        num_microbatches=NUM_MICROBATCHES, seq_length=0, micro_batch_size=1, forward_only=False,
        pg_collection=groups.pg_collection,  # explicit groups need an explicit p2p communicator too
        p2p_communicator=p2p_communication.P2PCommunicator(pp_group=groups.pp_group, config=model.config))
    success, grad_norm, _ = optimizer.step()
    return {
        "losses": [float(item["loss"]) for item in losses], "success": success, "grad_norm": float(grad_norm),
        "counts": counts, "applied": patches.applied_patches(), "optimizer": type(optimizer).__module__,
        "weights": full_state_dict(ddp_model, groups), "pp_rank": groups.pp_rank,
        "cuda_factory_device": str(schedules.torch.zeros(1, device="cuda").device),
        "function_modes": torch._C._len_torch_function_stack(),
    }


@pytest.fixture(scope="module")
def reference():
    """Single-process model: its full weights, per-micro-batch losses, grad norm and params after SGD."""
    groups = initialize_distributed(ParallelConfig(), seed=3)
    try:
        model = build_gpt_model(MODEL, ParallelConfig(), groups)
        full_sd = full_state_dict(model, groups)
        losses = []
        for packed in _micro_batches():
            logits = model(packed.input_ids, packed.position_ids, None, packed_seq_params=packed.packed_seq_params())
            loss = _summed_nll(logits, packed)
            (loss / NUM_MICROBATCHES).backward()  # the schedule divides each micro-batch loss by their count
            losses.append(loss.item())
        grads = {name: p.grad for name, p in model.named_parameters()}
        grad_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
        after = {name: full_sd[name] - LR * grad for name, grad in grads.items()}
        return full_sd, losses, grad_norm, after
    finally:
        destroy_distributed()


def test_version_table_matches_the_registry_and_setup_py():
    from megatron_rl import patches

    assert set(EXPECTED_PATCHES) == set(patches.TESTED_VERSIONS)
    assert MCORE_VERSION in patches.TESTED_VERSIONS, "CI runs the suite on the tested versions only"
    for version in patches.TESTED_VERSIONS:
        assert patches.in_supported_range(version)
    for patch in patches.registry():
        assert patch.versions and set(patch.versions) <= set(patches.TESTED_VERSIONS), patch.name
        assert patch.reason and patch.removal, patch.name
        assert patch.target == "megatron-core" + ",".join(f"=={v}" for v in patch.versions)
    for version, names in EXPECTED_PATCHES.items():
        assert [p.name for p in patches.registry() if p.applies_to(version)] == names, version
    setup_py = (Path(__file__).parents[1] / "setup.py").read_text()
    assert re.search(r'"megatron-core(.*?)"', setup_py).group(1) == patches.SUPPORTED_RANGE


@needs_cpu_patches
def test_registry_records_are_complete_and_apply_is_idempotent(caplog):
    from megatron_rl import patches

    with caplog.at_level(logging.INFO, logger="megatron_rl.patches"):
        first = patches.apply_cpu_patches()
        assert patches.apply_cpu_patches() == first == EXPECTED_PATCHES[MCORE_VERSION]
    from megatron.core.optimizer import clip_grads

    assert clip_grads.torch.zeros(1, device="cuda").device.type == "cpu"  # P1, in the modules it lists
    assert torch._C._len_torch_function_stack() == 0  # no global dispatch hook (issue 53)
    assert torch.ones(1).type() == "torch.cuda.FloatTensor" and torch.ones(1).cuda().device.type == "cpu"
    if "P9 torch.cuda.current_stream" in first:
        stream = torch.cuda.current_stream()
        stream.wait_event(None)
        stream.wait_stream(stream)


def test_on_a_cuda_machine_only_the_missing_package_patches_apply():
    """With CUDA (faked in a fresh process: the patches are process-global) only ``on_cuda`` patches apply: P12
    (fla stand-ins; a GPU machine without fla failed to build Qwen3.5 with "FLA is not installed" before)."""
    import subprocess
    import sys

    code = ("import torch; torch.cuda.is_available = lambda: True\n"
            "from megatron_rl.patches import apply_cpu_patches, registry\n"
            "print(apply_cpu_patches(), [p.name for p in registry() if p.on_cuda])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[1], check=True).stdout.strip().splitlines()[-1]
    on_cuda = [name for name in EXPECTED_PATCHES[MCORE_VERSION] if name.startswith("P12")]
    assert out == f"{on_cuda} ['P12 fla stand-ins for Gated-DeltaNet']"


# megatron-core modules with a device="cuda" factory that P1 leaves alone, and why: none runs on megatron_rl's CPU
# paths (the previous global TorchFunctionMode, logging every call it translated, saw none of them in the suite)
_P1_NOT_NEEDED = {
    "megatron.core.distributed.fsdp.": "Megatron FSDP (megatron_rl wraps with DDP)",
    "megatron.core.distributed.param_and_grad_buffer": "only with nccl_ub (NCCL user buffers)",
    "megatron.core.inference.": "megatron-core's inference (rollouts use megatron_rl's engines)",
    "megatron.core.resharding.": "NVSHMEM resharding",
    "megatron.core.energy_monitor": "GPU energy",
    "megatron.core.fp8_utils": "FP8 (TransformerEngine)",
    "megatron.core.full_cuda_graph": "CUDA graphs",
    "megatron.core.transformer.cuda_graphs": "CUDA graphs",
    "megatron.core.nccl_allocator": "NCCL memory pools",
    "megatron.core.fusions.": "fused CUDA kernels (fusions off on CPU)",
    "megatron.core.models.hybrid.hybrid_block": "static-batching inference with CUDA graphs / flash decode",
    "megatron.core.ssm.mamba_block": "static-batching inference with CUDA graphs / flash decode",
    "megatron.core.models.mimo.": "MIMO models",
    "megatron.core.pipeline_parallel.fine_grained_activation_offload": "activation offloading",
    "megatron.core.pipeline_parallel.hybrid_cp_schedule": "hybrid context-parallel schedule",
    "megatron.core.pipeline_parallel.utils": "CUDA streams of the overlapped schedules",
    "megatron.core.tensor_parallel.data": "broadcast_data (every rank plans its own batch)",
    "megatron.core.transformer.moe.moe_layer": "the delayed-wgrad CUDA stream",
    "megatron.core.transformer.moe.paged_stash": "paged stash",
    "megatron.core.transformer.moe.token_dispatcher": "HybridEP (DeepEP) dispatcher",
}


@pytest.mark.core
def test_p1_lists_every_module_with_a_cuda_factory_on_our_paths():
    """Every megatron-core module of the installed version that names device="cuda" in a factory is either
    rebound by P1 or listed above with the reason it never runs here (a new version's new call site fails this
    test instead of a run). ~0.3 s: a regex over megatron-core's sources."""
    import megatron.core

    from megatron_rl.patches import cuda_factories

    root = Path(megatron.core.__file__).parent
    found = {"megatron.core." + ".".join(path.relative_to(root).with_suffix("").parts)
             for path in root.rglob("*.py") if re.search(r"device=['\"]cuda", path.read_text(errors="replace"))}
    listed = set(cuda_factories.modules_for(MCORE_VERSION))
    missing = sorted(m for m in found - listed if not any(m.startswith(k) for k in _P1_NOT_NEEDED))
    assert not missing, f"add these to patches/cuda_factories.py MODULES or to _P1_NOT_NEEDED: {missing}"


def test_version_mismatch_refused(monkeypatch):
    from megatron_rl import patches

    monkeypatch.setattr(patches.importlib.metadata, "version", lambda name: "0.99.0")
    monkeypatch.delenv(patches.ALLOW_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"supports megatron-core>=0\.16\.1,<0\.20 \(tested: 0\.16\.1 and "
                                           r"0\.19\.2\) but 0\.99\.0 is installed"):
        patches.check_megatron_version()
    monkeypatch.setenv(patches.ALLOW_ENV, "1")
    with pytest.warns(UserWarning, match="0.99.0"):
        assert patches.check_megatron_version() == "0.99.0"


def test_untested_version_in_range_warns_and_applies_every_patch(monkeypatch):
    from megatron_rl import patches

    monkeypatch.setattr(patches.importlib.metadata, "version", lambda name: "0.18.0")
    monkeypatch.delenv(patches.ALLOW_ENV, raising=False)
    with pytest.warns(UserWarning, match=r"0\.18\.0 is in megatron_rl's supported range .* CI tests only"):
        assert patches.check_megatron_version() == "0.18.0"
    assert all(p.applies_to("0.18.0") for p in patches.registry())


@needs_cpu_patches
@pytest.mark.multirank
def test_megatron_schedule_ddp_optimizer_run_on_cpu_pp2(reference):
    full_sd, ref_losses, ref_grad_norm, ref_after = reference
    out = run_ranks(2, _pp2_train_step, full_sd, _micro_batches())
    first, last = sorted(out, key=lambda o: o["pp_rank"])
    for o in out:
        assert o["applied"] == EXPECTED_PATCHES[MCORE_VERSION]
        assert o["cuda_factory_device"] == "cpu" and o["function_modes"] == 0
        assert o["optimizer"].startswith("megatron.core.optimizer") and o["success"]
        counts = o["counts"]
        assert counts["forward_backward_pipelining_without_interleaving"] == 1
        assert counts["finalize_model_grads"] == 1 and counts["finish_grad_sync"] >= 1
        assert counts["_communicate"] >= NUM_MICROBATCHES and counts["current_device"] >= 1
        assert o["grad_norm"] == pytest.approx(ref_grad_norm, rel=1e-5)
    assert first["losses"] == []  # losses live on the last stage
    assert last["losses"] == pytest.approx(ref_losses, rel=1e-6)
    for o in out:
        assert o["weights"].keys() == ref_after.keys()
        for name, expected in ref_after.items():
            torch.testing.assert_close(o["weights"][name], expected, rtol=0, atol=2e-6, msg=name)
