"""A teacher served by the real vLLM engine (``distillation.teachers[i].engine: vllm``, distillation/served.py).

The teacher is a tiny fp32 Llama (4 layers, hidden 96, 3 heads of 32: vLLM's CPU attention needs head size >= 32),
served by ``vllm serve`` in fp32; the student's batch is six left-padded rows of different lengths. Checked:
- its response log-probs equal ``transformers``' forward of each sequence alone, and the in-trainer teacher's
  (``engine: megatron``, packed THD) on the same batch, within the fp32 engine bound (1e-4, as
  tests/job/test_vllm_main_job.py); columns outside each row's response stay 0;
- an off-by-one (the log-prob of token t+1 in token t's column) is far outside the bound;
- a row as long as the student's context (``rollout.max_model_len``), which is also the teacher's
  ``max_position_embeddings``, is scored (the server's context leaves room for the one token vLLM generates: it
  answered HTTP 400 "max_tokens must be at least 1" before);
- the server's log is ``<logging.output_dir>/engine/teacher_<name>.log`` and ``Distillation.close`` kills it;
- a SIGKILLed server is started again by the next scoring pass, which gives the same log-probs (one restart
  counted); a teacher with ``url`` attaches that server (the job's token from ``$MEGATRON_RL_ENGINE_TOKEN``),
  scores the same, and its ``close`` leaves the server running. Planted bug checked by hand: without the
  restart (``_score_healing`` scoring directly) the second pass raises ``EngineError``.
Cost: ~25-45 s on 2 cores (two forked engine starts, one Megatron teacher build).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.distillation.config import DistillationConfig
from tests.distill.conftest import make_teacher

PROMPTS = [[5, 9, 3], [7, 4, 4, 11, 6, 20, 8], [3, 3]]
RESPONSES = [[12, 40, 7, 9], [100, 3], [55, 6, 17, 90, 31, 4], [8], [127, 64, 5], [9, 9, 9, 2, 77]]
LONGEST = max(len(PROMPTS[i // 2]) + len(r) for i, r in enumerate(RESPONSES))  # row 2: 7 + 6 tokens
TOLERANCE = 1e-4  # fp32 engine vs trainer, as in tests/job/test_vllm_main_job.py


def test_the_engine_key_is_megatron_or_vllm():
    config = DistillationConfig(teachers=[{"name": "t", "hf_path": "/ckpt", "engine": "vllm"}])
    assert config.teachers[0].engine == "vllm"
    assert DistillationConfig(teachers=[{"name": "t", "hf_path": "/ckpt"}]).teachers[0].engine == "megatron"
    with pytest.raises(ConfigError, match=r"distillation.teachers\[0\].engine='sglang' must be one of"):
        DistillationConfig(teachers=[{"name": "t", "hf_path": "/ckpt", "engine": "sglang"}])


def _rollouts() -> dict:
    prompts = [p for p in PROMPTS for _ in range(2)]
    return {"prompt_token_ids": prompts, "response_ids": RESPONSES, "rewards": [0.0] * len(prompts),
            "loss_masks": [[1] * len(r) for r in RESPONSES], "uids": [i // 2 for i in range(len(prompts))]}


def _hf_logprobs(teacher_dir) -> list[torch.Tensor]:
    """transformers' log-probs of each row's response tokens, one sequence at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    rows = []
    for prompt, response in zip(_rollouts()["prompt_token_ids"], RESPONSES):
        tokens = torch.tensor([prompt + response])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=tokens).logits.float(), dim=-1)[0, :-1]
        rows.append(logp.gather(-1, tokens[0, 1:, None]).squeeze(-1)[-len(response):])
    return rows


def _config(teacher_dir, engine: str, output_dir, url: str | None = None):
    from megatron_rl.config import LoggingConfig, MegatronRLConfig, ModelConfig

    teacher = {"name": "t", "hf_path": str(teacher_dir), "engine": engine, **({"url": url} if url else {})}
    return MegatronRLConfig(model=ModelConfig(attention_backend="local"),
                            logging=LoggingConfig(output_dir=str(output_dir)),
                            distillation=DistillationConfig(teachers=[teacher]))


def _scores(distillation, batch) -> torch.Tensor:
    from megatron_rl.distillation.signal import TEACHER_LOGPROBS

    distillation.score(batch)
    return batch.tensors.pop(TEACHER_LOGPROBS.format(name="t"))


@pytest.mark.engine
def test_a_served_teacher_scores_like_transformers_and_the_in_trainer_teacher(groups, engine_py, tmp_path,
                                                                             monkeypatch):
    from megatron_rl.data.batch import TrainingBatch
    from megatron_rl.distillation.teachers import build_distillation
    from megatron_rl.inference.config import RolloutConfig

    # the student's context and the teacher's positions are the longest row's length: that row fills both
    teacher_dir = make_teacher(tmp_path / "teacher", heads=3, kv_heads=1, positions=LONGEST)
    rollout = RolloutConfig(engine="vllm", engine_python=engine_py, dtype="float32", max_model_len=LONGEST,
                            start_timeout_s=300)
    batch = TrainingBatch.from_generator_output(_rollouts(), pad_token_id=0)
    mask = batch["response_mask"]
    served = build_distillation(_config(teacher_dir, "vllm", tmp_path / "out"), groups, 0, rollout)
    teacher = served.teachers[0]
    try:
        got = _scores(served, batch)
        os.killpg(teacher.server.proc.pid, signal.SIGKILL)  # as a user's kill -9 (or the OOM killer) would
        while teacher.server.proc.poll() is None:
            time.sleep(0.1)
        again = _scores(served, batch)  # the next pass starts it again
        assert teacher.restarts == 1 and teacher.server.alive()
        assert (again - got).abs().max() <= 1e-6
        monkeypatch.setenv("MEGATRON_RL_ENGINE_TOKEN", teacher.server.token)
        attached = build_distillation(_config(teacher_dir, "vllm", tmp_path / "out", url=teacher.server.url), groups,
                                      0, rollout)
        assert attached.teachers[0].relaunch is None and (_scores(attached, batch) - again).abs().max() <= 1e-6
        attached.close()
        assert teacher.server.alive()  # an attached server is the user's: never killed
        process = teacher.server.proc
    finally:
        served.close()
    assert (tmp_path / "out" / "engine" / "teacher_t.log").is_file()
    assert process.poll() is not None and served.teachers[0].server is None  # killed
    in_trainer = build_distillation(_config(teacher_dir, "megatron", tmp_path / "out"), groups, 0)
    expected = _scores(in_trainer, batch)

    assert got.shape == mask.shape and got.dtype == torch.float32
    assert torch.all(got[mask == 0] == 0)
    for i, reference in enumerate(_hf_logprobs(teacher_dir)):
        row = got[i, mask.shape[1] - len(reference):]
        assert (row - reference).abs().max() <= TOLERANCE, (i, row, reference)
    assert ((got - expected) * mask).abs().max() <= TOLERANCE
    shifted = torch.roll(got, -1, dims=1) * mask  # token t's column holding token t+1's log-prob
    assert ((shifted - expected) * mask).abs().max() > 100 * TOLERANCE
