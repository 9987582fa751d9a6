"""A teacher served by a vLLM engine of its own (``distillation.teachers[i].engine: vllm``; docs/DISTILLATION.md).

Place in the data flow: the same seam as the in-trainer teacher. ``Distillation.score`` (signal.py) calls
``teacher.forward(rows)["logprobs"]`` on every rank with the same rows; ``ServedTeacher.forward`` answers with the
same ``[B, R]`` layout as ``MegatronPolicy.forward`` (response tokens right-aligned, 0 elsewhere):

    rank 0: each row's unpadded ``prompt + response`` ids as the prompt of ONE ``/v1/completions`` request
            (``max_tokens: 1``, ``prompt_logprobs: 0``): vLLM answers, per prompt position ``j >= 1``, the log-prob
            of token ``j`` given tokens ``< j`` -> the last ``r_i`` of them are row i's response log-probs
    rank 0 -> every rank: ``broadcast_object_list`` of the ``[B, R]`` tensor (or of rank 0's error: every rank
            raises the same ``EngineError``, none waits in a collective)

Which log-probs vLLM returns (vllm 0.32 ``v1/worker/gpu_model_runner.py _get_prompt_logprobs_dict``): prompt
tokens skip the sampling processors (temperature, top-p/top-k, penalties), so whatever ``--logprobs-mode`` the
server runs with (``processed_logprobs``, server.py) a prompt log-prob is the raw ``log_softmax`` of the model's
logits in fp32: what the in-trainer teacher computes (tests/distill/test_distill_served.py checks both against
``transformers``).

Lifecycle: rank 0 starts ``vllm serve`` on the teacher's checkpoint at set-up (``ServedTeacher.start``, the
engine server of inference/vllm/server.py: its own token, loopback, a free port, a watchdog that kills it with the
trainer), its log in ``<logging.output_dir>/engine/teacher_<name>.log``; ``close`` kills it. A server that dies
(a kill, an out-of-memory) is started again at the next scoring pass, which then runs on the new one: one line
per restart, at most ``MAX_RESTARTS`` in a run (then the run stops with the log's tail). Or
``distillation.teachers[i].url`` attaches a server started elsewhere (``ServedTeacher.attach``; the
``vllm_serve`` command of docs/INFERENCE.md with ``$MEGATRON_RL_ENGINE_TOKEN``, which the job reads too): the job
never kills or restarts it. No weight sync: the teacher is frozen. On CPU it takes vLLM's default cores (it runs while the policy's engines wait for the step);
on GPU the device after the policy's vLLM engines, else device 0 (shared with the trainer there, within
``rollout.gpu_memory_utilization``).
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.inference.engine import EngineError, EngineStartError

MAX_RESTARTS = 3
"""How many times a run starts a dead teacher server again before it stops."""
SCORE_MAX_TOKENS = 1
"""vLLM generates at least one token per request; the scoring request asks for one and ignores it."""


def scoring_request(prompts: list[list[int]], model: str) -> dict:
    """The ``/v1/completions`` body that scores ``prompts`` (token ids): each prompt token's log-prob given the
    ones before it, and one generated token that nobody reads."""
    return {"model": model, "prompt": prompts, "max_tokens": SCORE_MAX_TOKENS, "temperature": 1.0,
            "prompt_logprobs": 0, "ignore_eos": True, "return_token_ids": True, "skip_special_tokens": False}


def token_logprob(entry: dict | None, token: int) -> float:
    """The log-prob of ``token`` in one ``prompt_logprobs`` entry ``{token id: {logprob, rank, ...}}`` (the keys are
    the ids as JSON strings; with ``prompt_logprobs: 0`` the prompt's own token is the only one)."""
    if not entry:
        raise EngineError("the teacher engine gave no log-prob for a scored token (the first token of a prompt has "
                          "none: a row without a prompt cannot be scored)")
    found = entry.get(str(token)) or entry.get(f"token_id:{token}")
    if found is None:
        raise EngineError(f"the teacher engine's prompt log-probs lack token {token} (got ids {list(entry)[:4]})")
    return float(found["logprob"] if isinstance(found, dict) else found)


def rows_to_prompts(batch: Any) -> tuple[list[list[int]], list[int]]:
    """Each row's unpadded ``prompt + response`` ids and its response length ``r_i``."""
    sequences, attention = batch["sequences"], batch["attention_mask"].bool()
    lengths = batch["response_mask"].sum(dim=1).tolist()
    return [sequences[i][attention[i]].tolist() for i in range(len(sequences))], [int(r) for r in lengths]


def response_logprobs(choices: list[dict], prompts: list[list[int]], lengths: list[int], width: int
                      ) -> torch.Tensor:
    """``[B, width]`` fp32: row i's last ``lengths[i]`` columns are the log-probs of its last ``lengths[i]`` prompt
    tokens (its response), the rest 0."""
    out = torch.zeros((len(prompts), width), dtype=torch.float32)
    by_index = {int(choice["index"]): choice for choice in choices}
    for i, (prompt, r) in enumerate(zip(prompts, lengths)):
        entries = (by_index.get(i) or {}).get("prompt_logprobs")
        if entries is None or len(entries) != len(prompt):
            raise EngineError(f"the teacher engine scored row {i} with {None if entries is None else len(entries)} "
                              f"prompt log-probs for its {len(prompt)} tokens")
        start = len(prompt) - r
        values = [token_logprob(entries[j], prompt[j]) for j in range(start, len(prompt))]
        if r:
            out[i, width - r:] = torch.tensor(values, dtype=torch.float32)
    return out


def served_options(rollout: Any, model_cfg: Any, device_type: str, max_model_len: int, seed: int) -> Any:
    """The teacher server's ``ServeOptions``: the policy engines' interpreter, dtype rule, KV cache and memory
    share (``rollout.*``); no LoRA, no sleep mode, no scale-out. ``max_model_len``: the student's longest
    ``prompt + response`` plus ``SCORE_MAX_TOKENS`` (vLLM refuses a prompt that leaves no room for the one
    generated token: "max_tokens must be at least 1"); past the teacher's ``max_position_embeddings`` (``model_cfg``)
    only by that token, which nobody reads (``long_context``)."""
    from megatron_rl.inference.config import engine_dtype
    from megatron_rl.inference.vllm.launcher import engine_python
    from megatron_rl.inference.vllm.server import ServeOptions

    return ServeOptions(python=engine_python(rollout), dtype=engine_dtype(rollout, model_cfg, device_type)[0],
                        max_model_len=max_model_len, seed=seed, kv_cache_gib=rollout.kv_cache_gib,
                        gpu_memory_utilization=rollout.gpu_memory_utilization,
                        long_context=max_model_len > model_cfg.max_position_embeddings)


class ServedTeacher:
    """A frozen teacher in its own ``vllm serve`` (rank 0 holds the server; every rank calls ``forward``)."""

    def __init__(self, name: str, server: Any, *, timeout_s: float, relaunch: Callable[[], Any] | None = None,
                 model: str | None = None) -> None:
        self.name = name
        self.model = model
        """The served model's name in requests (an attached server's own); None: the job's (``MODEL_NAME``)."""
        self.server = server
        """The ``EngineServer`` on rank 0, None elsewhere."""
        self.timeout_s = timeout_s
        self.relaunch = relaunch
        """Rank 0, a server the job started: starts it again (a ready ``EngineServer``); None: never restarted."""
        self.restarts = 0

    @classmethod
    def start(cls, name: str, hf_path: str, options: Any, *, rank: int, log_path: Path, start_timeout_s: float,
              timeout_s: float, device: str | None = None) -> "ServedTeacher":
        """Rank 0 starts the server on ``hf_path`` and waits for it (EngineStartError with its log's tail)."""
        from megatron_rl.inference.vllm.server import EngineServer

        def launch() -> Any:
            server = EngineServer.start(Path(hf_path), options, token=secrets.token_urlsafe(32), log_path=log_path,
                                        devices=device)
            try:
                server.wait_ready(start_timeout_s, what=f"the vLLM server of teacher {name!r}")
            except EngineStartError:
                server.kill()
                raise
            return server

        if rank != 0:
            return cls(name, None, timeout_s=timeout_s)
        return cls(name, launch(), timeout_s=timeout_s, relaunch=launch)

    @classmethod
    def attach(cls, name: str, url: str, *, rank: int, start_timeout_s: float, timeout_s: float) -> "ServedTeacher":
        """Rank 0 takes the server at ``url`` (token: ``$MEGATRON_RL_ENGINE_TOKEN``) and waits until it answers."""
        from megatron_rl.inference.engine_process.vllm_serve import TOKEN_ENV
        from megatron_rl.inference.vllm.server import EngineServer

        server = None
        if rank == 0:
            token = os.environ.get(TOKEN_ENV)
            if not token:
                raise EngineStartError(f"teacher {name!r} attaches the server at {url}, which needs its token: set "
                                       f"${TOKEN_ENV} to the value the server was started with (docs/INFERENCE.md)")
            server = EngineServer.attach(url, token)
            model = server.wait_ready(start_timeout_s, what=f"the vLLM server of teacher {name!r}").get("id")
            return cls(name, server, timeout_s=timeout_s, model=model)
        return cls(name, server, timeout_s=timeout_s)

    def _score(self, batch: Any) -> torch.Tensor:
        from megatron_rl.inference.vllm.server import MODEL_NAME

        prompts, lengths = rows_to_prompts(batch)
        body = scoring_request(prompts, self.model or MODEL_NAME)
        choices = self.server.call("POST", "/v1/completions", body, timeout_s=self.timeout_s)["choices"]
        return response_logprobs(choices, prompts, lengths, batch["response_mask"].shape[1])

    def _restart(self) -> None:
        """Start a dead server again (one line), or EngineError once ``MAX_RESTARTS`` are spent."""
        from megatron_rl.inference.vllm.server import log_tail

        code = getattr(self.server.proc, "returncode", None)
        if self.restarts >= MAX_RESTARTS:
            raise EngineError(f"its server died again (exit {code}) after {MAX_RESTARTS} restarts; last lines of "
                              f"{self.server.log_path}:\n{log_tail(self.server.log_path)}")
        self.restarts += 1
        print(f"megatron_rl: the vLLM server of teacher {self.name!r} died (exit {code}): starting it again "
              f"(restart {self.restarts} of at most {MAX_RESTARTS})", file=sys.stderr, flush=True)
        self.server.kill()
        self.server = self.relaunch()

    def _score_healing(self, batch: Any) -> torch.Tensor:
        """``_score``, on a server started again first when the job's own server has died."""
        from megatron_rl.inference.vllm.server import EngineDown

        if self.relaunch is not None and not self.server.alive():
            self._restart()
        try:
            return self._score(batch)
        except EngineDown:
            if self.relaunch is None or self.server.alive():
                raise
            self._restart()  # it died during the request
            return self._score(batch)

    @torch.no_grad()
    def forward(self, batch: Any) -> dict[str, torch.Tensor]:
        """``{"logprobs": [B, R]}`` of the rows of ``batch`` on every rank (collective when distributed)."""
        payload: list[Any] = [None]
        if self.server is not None:
            try:
                payload[0] = self._score_healing(batch)
            except Exception as err:  # noqa: BLE001 (any failure: every rank raises it, none hangs)
                payload[0] = f"teacher {self.name!r} (vLLM at {self.server.url}): {type(err).__name__}: {err}"
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)
        if isinstance(payload[0], str):
            raise EngineError(payload[0])
        return {"logprobs": payload[0]}

    def close(self) -> None:
        """Kill the server the job started (idempotent; an attached one is left running)."""
        if self.server is not None:
            self.server.kill()
            self.server = None
