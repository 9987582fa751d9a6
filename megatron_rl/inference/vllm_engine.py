"""vLLM as the rollout engine: its own process and Python environment, fed the policy's weights in place.

Place in the data flow: the main job (or a user's loop) calls ``VLLMEngine.start`` once, ``generate`` per
batch of prompts and ``update_weights`` after the optimizer steps; all three are collective over the trainer's
ranks (``engine.RolloutEngine``). Global rank 0 owns the engine process; the other ranks get its completions by
a broadcast, and the senders of each pipeline stage stream their own weights (``weight_sync.py``).

Lifecycle (``EngineProcess``): ``<rollout.engine_python> -m megatron_rl.inference.vllm_server`` starts in a new
session, talks to rank 0 over an authenticated local connection, and kills its whole process group when rank 0
is gone (watchdog in ``vllm_server.py``): Ctrl-C, an exception or a SIGKILL of the trainer leaves no engine
process. ``close`` (also registered with ``atexit``) shuts it down politely first. A start that fails or times
out raises ``EngineStartError`` with the tail of the engine's log (``<work_dir>/engine.log``) on every rank.

Start-up: the policy's current weights are exported as an HF folder (``<work_dir>/model``; the config comes
from ``hf_dir``, or is written from ``model.*`` for a model trained from scratch, ``hf/config.py``), and vLLM
loads it with ``skip_tokenizer_init`` (token ids in and out; the job owns its tokenizer).
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.inference.config import RolloutConfig
from megatron_rl.inference.engine import Completion, SamplingSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The directory that holds the ``megatron_rl`` package (put on the engine's PYTHONPATH)."""

_TRAINER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "PYTHONPATH", "VIRTUAL_ENV")


class EngineStartError(RuntimeError):
    """The engine did not start (the message ends with the tail of its log)."""


class EngineError(RuntimeError):
    """The engine failed on a request (the message carries the engine's traceback)."""


def engine_python(config: RolloutConfig) -> str:
    """The engine environment's interpreter; ValueError naming the key and the set-up command if missing."""
    path = config.engine_python or os.environ.get("MEGATRON_RL_ENGINE_PYTHON") or str(
        REPO_ROOT / ".venv-engine" / "bin" / "python")
    if not Path(path).is_file() and shutil.which(path) is None:
        raise ValueError(
            f"rollout.engine=vllm but the engine's Python {path!r} does not exist: run `bash scripts/setup_engine.sh` "
            "(makes .venv-engine), or set rollout.engine_python (or $MEGATRON_RL_ENGINE_PYTHON) to a Python with vllm"
        )
    return path


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no engine log)"
    return "\n".join(text[-lines:])


class EngineProcess:
    """The engine process and rank 0's connection to it (not collective)."""

    def __init__(self, python: str, model_dir: Path, *, log_path: Path, dtype: str, max_model_len: int,
                 seed: int, timeout_s: float, kv_cache_gib: float, gpu_memory_utilization: float) -> None:
        authkey = secrets.token_hex(32).encode()
        self.listener = Listener(("127.0.0.1", 0), authkey=authkey)
        self.log_path = log_path
        self.conn: Any = None
        self.pending = False
        host, port = self.listener.address
        env = {k: v for k, v in os.environ.items() if k not in _TRAINER_ENV}
        env.update(
            PYTHONPATH=str(REPO_ROOT), MEGATRON_RL_ENGINE_AUTHKEY=authkey.decode(),
            VLLM_ENABLE_V1_MULTIPROCESSING="0",  # one engine process (start-up ~3 s instead of 20-90 s on CPU)
            VLLM_CPU_KVCACHE_SPACE=str(max(1, round(kv_cache_gib))), PYTHONUNBUFFERED="1",
        )  # fmt: skip
        log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [python, "-m", "megatron_rl.inference.vllm_server", "--model", str(model_dir),
                   "--address", f"{host}:{port}", "--parent-pid", str(os.getpid()), "--dtype", dtype,
                   "--max-model-len", str(max_model_len), "--seed", str(seed),
                   "--gpu-memory-utilization", str(gpu_memory_utilization)]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(REPO_ROOT))
        atexit.register(self.kill)
        try:
            self.info = self._accept(timeout_s)
        except BaseException:
            self.kill()
            raise

    def _accept(self, timeout_s: float) -> dict:
        accepted: list = []
        thread = threading.Thread(target=lambda: accepted.append(self.listener.accept()), daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive():
            thread.join(0.2)
            if self.proc.poll() is not None and thread.is_alive():
                raise EngineStartError(f"the vLLM engine exited with code {self.proc.returncode} while starting; "
                                       f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")
            if time.monotonic() > deadline:
                raise EngineStartError(f"the vLLM engine did not start within {timeout_s:.0f} s "
                                       f"(rollout.start_timeout_s); last lines of {self.log_path}:\n"
                                       f"{log_tail(self.log_path)}")
        self.conn = accepted[0]
        kind, info = self.conn.recv()
        assert kind == "ready", kind
        return info

    def post(self, command: str, **kwargs: Any) -> None:
        """Send a request without waiting (``result`` collects the answer)."""
        assert not self.pending, "one request at a time"
        self.conn.send((command, kwargs))
        self.pending = True

    def result(self) -> Any:
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError) as err:
            raise EngineError(f"the vLLM engine died (exit code {self.proc.poll()}); last lines of "
                              f"{self.log_path}:\n{log_tail(self.log_path)}") from err
        finally:
            self.pending = False
        if status != "ok":
            raise EngineError(f"the vLLM engine failed:\n{value}")
        return value

    def call(self, command: str, **kwargs: Any) -> Any:
        self.post(command, **kwargs)
        return self.result()

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the engine to shut down, then make sure its whole process group is gone."""
        if self.proc.poll() is None and self.conn is not None and not self.pending:
            try:
                self.post("shutdown")
                if self.conn.poll(timeout_s):
                    self.result()
                self.proc.wait(timeout=timeout_s)
            except Exception:  # it is killed below either way
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the engine's process group (idempotent)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        self.listener.close()
        atexit.unregister(self.kill)


class VLLMEngine:
    """``RolloutEngine`` backed by vLLM (module docstring). Build with ``VLLMEngine.start``."""

    def __init__(self, policy: Any, config: RolloutConfig, *, process: EngineProcess | None, hf_source: str,
                 work_dir: Path, transport: str) -> None:
        self.policy = policy
        self.groups = policy.groups
        self.config = config
        self.process = process
        self.hf_source = hf_source
        self.work_dir = work_dir
        self.transport = transport
        self.version = 0
        self.sender: Any = None
        self.store: Any = None
        self.record_digests = False
        """Tests: the engine records a sha256 per received tensor (``digests``)."""
        self.last_stats: dict = {}
        self._last_seed: int | None = None
        self._seed_calls = 0
        """Rank 0: the last sync's engine and sender statistics."""
        self.last_sender_tensors = 0
        """Tensors this rank sent in the last sync (0 on a rank that sends nothing)."""

    # ---------------------------------------------------------------------------------------------- start
    @classmethod
    def start(cls, policy: Any, config: RolloutConfig, *, hf_dir: str | os.PathLike | None = None,
              work_dir: str | os.PathLike, seed: int = 0) -> "VLLMEngine":
        """Export ``policy``'s weights, start the engine on them, and connect the weight sync (collective)."""
        from megatron_rl.hf.config import write_hf_config
        from megatron_rl.hf.weights import export_hf

        groups = policy.groups
        work_dir = Path(work_dir)
        model_cfg = policy.config.model
        python = engine_python(config)  # the same check on every rank: a ValueError before any collective
        transport = config.weight_transport
        if transport == "auto":
            transport = "nccl" if groups.device.type == "cuda" else "gloo"
        if hf_dir is None:
            hf_source = str(work_dir / "hf_config")
            if groups.rank == 0:
                write_hf_config(model_cfg, hf_source)
            dist.barrier()
        else:
            hf_source = str(hf_dir)
        model_dir = work_dir / "model"
        export_hf([policy.module], model_dir, hf_source, groups)
        dtype = model_cfg.params_dtype if config.dtype == "auto" else config.dtype
        process, error = None, None
        if groups.rank == 0:
            try:
                process = EngineProcess(
                    python, model_dir, log_path=work_dir / "engine.log", dtype=dtype,
                    max_model_len=config.max_model_len or model_cfg.max_position_embeddings, seed=seed,
                    timeout_s=config.start_timeout_s, kv_cache_gib=config.kv_cache_gib,
                    gpu_memory_utilization=config.gpu_memory_utilization,
                )  # fmt: skip
            except EngineStartError as err:
                error = str(err)
        _raise_everywhere(error, EngineStartError)
        engine = cls(policy, config, process=process, hf_source=hf_source, work_dir=work_dir, transport=transport)
        try:
            if transport != "disk":
                engine._join_sync(backend=transport, timeout_s=config.start_timeout_s)
        except BaseException:
            engine.close()
            raise
        return engine

    def _join_sync(self, *, backend: str, timeout_s: float) -> None:
        from megatron_rl.inference.weight_sync import WeightSender

        groups = self.groups
        host = os.environ.get("MASTER_ADDR", "127.0.0.1") if groups.world_size > 1 else "127.0.0.1"
        port = [0]
        if groups.rank == 0:
            self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
            port = [self.store.port]
        dist.broadcast_object_list(port, src=0)
        self.sender = WeightSender(groups, bucket_bytes=int(self.config.bucket_mb * 2**20), backend=backend)
        error = None
        if groups.rank == 0:
            self.process.post("sync_join", host="127.0.0.1", port=port[0], num_senders=groups.pp_size,
                              backend=backend, timeout_s=timeout_s)
        self.sender.join(host, port[0], num_workers=1, timeout_s=timeout_s)
        if groups.rank == 0:
            try:
                self.process.result()
            except EngineError as err:
                error = str(err)
        _raise_everywhere(error, EngineError)

    # ---------------------------------------------------------------------------------------------- use
    def generate(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec, *, seed: int) -> list[Completion]:
        """One completion per prompt, sampled by the engine, identical on every rank (collective)."""
        # a call that repeats the previous call's seed continues its stream (engine.py): a fresh seed per call
        self._seed_calls = self._seed_calls + 1 if seed == self._last_seed else 0
        self._last_seed = seed
        call_seed = seed * 64 + self._seed_calls
        payload: list = [None]
        if self.groups.rank == 0:
            try:
                payload = [("ok", self.process.call(
                    "generate", prompts=[[int(t) for t in p] for p in prompts], sampling=asdict(spec),
                    seed=call_seed))]
            except EngineError as err:
                payload = [("error", str(err))]
        if self.groups.world_size > 1:
            dist.broadcast_object_list(payload, src=0)
        status, value = payload[0]
        if status != "ok":
            raise EngineError(value)
        return [Completion(token_ids=list(ids), logprobs=list(lps), finish_reason=reason)
                for ids, lps, reason in value]

    def update_weights(self, policy: Any = None) -> float:
        """Put the policy's current weights into the engine (collective); returns the seconds it took."""
        from megatron_rl.hf.weights import export_hf

        policy = policy or self.policy
        started = time.perf_counter()
        self.version += 1
        error = None
        if self.transport == "disk":
            path = self._sync_dir() / f"v{self.version}"
            export_hf([policy.module], path, self.hf_source, self.groups)
            if self.groups.rank == 0:
                try:
                    self.process.call("reload_path", path=str(path))
                except EngineError as err:
                    error = str(err)
                shutil.rmtree(path, ignore_errors=True)
        else:
            if self.groups.rank == 0:
                self.process.post("sync_receive", version=self.version, record_digests=self.record_digests)
            stats = self.sender.send([policy.module], self.hf_source, self.version)
            self.last_sender_tensors = stats.tensors
            if self.groups.rank == 0:
                try:
                    self.last_stats = {"engine": self.process.result(), "sender": asdict(stats)}
                except EngineError as err:
                    error = str(err)
        _raise_everywhere(error, EngineError)
        return time.perf_counter() - started

    def raw_bandwidth(self, nbytes: int, repeats: int = 3) -> float:
        """Bytes/s of plain broadcasts from sender 0 to the engine over the sync group (rank 0 only; bench)."""
        self.process.post("raw_receive", nbytes=nbytes, repeats=repeats)
        seconds = self.sender.raw_send(nbytes, repeats)
        self.process.result()
        return nbytes * repeats / seconds

    def digests(self) -> dict[str, str]:
        """sha256 per HF name of the tensors the engine received in the last sync (rank 0; needs
        ``record_digests`` set before that sync)."""
        return self.process.call("digests") if self.process is not None else {}

    def _sync_dir(self) -> Path:
        if self.config.sync_dir:
            return Path(self.config.sync_dir)
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        return base / f"megatron_rl_sync_{os.environ.get('MASTER_PORT', os.getpid())}"

    def close(self) -> None:
        """Shut the engine down and leave the sync groups (idempotent)."""
        if self.process is not None:
            self.process.close()
            self.process = None
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        self.store = None
        if self.transport == "disk" and not self.config.sync_dir and self.groups.rank == 0:
            shutil.rmtree(self._sync_dir(), ignore_errors=True)  # the default one under /dev/shm: ours alone


def _raise_everywhere(error: str | None, kind: type[Exception]) -> None:
    """Rank 0's error (or None) on every rank, so every rank raises the same exception instead of hanging."""
    payload = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    if payload[0] is not None:
        raise kind(payload[0])
