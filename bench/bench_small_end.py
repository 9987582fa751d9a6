"""The small end: the job a newcomer starts with, through megatron_rl's main job and through TRL's GRPOTrainer.

    .venv/bin/python bench/bench_small_end.py [--steps 20] [--systems builtin,trl] [--vllm] [--rounds 3] [--out results.json]

The job (issue 36): a random 2-layer Qwen3 (hidden 64, 4 heads of 32, ``examples/common.py tiny_qwen3``) with
a word-level tokenizer built locally, 8 prompts x 8 samples per step, at most 16 new tokens, Adam at 1e-5, one
optimizer step per RL step, no KL, 20 steps. Systems, run one after the other on the same files:

    builtin   bash run_megatron.sh ... NPROC=1 (rollout.engine builtin, the default)
    vllm      the same with rollout.engine=vllm (--vllm; needs MEGATRON_RL_ENGINE_PYTHON, docs/INFERENCE.md)
    engine    the vLLM engine alone (no trainer): ``vllm serve`` as the job starts it, sent each step's requests
              (8 prompts x ``n=8``, 16 tokens, concurrently, as the fleet sends them): the floor under the vllm
              system's rollout (its column is the time of each step's requests)
    trl       TRL's GRPOTrainer on CPU with its own defaults (plain transformers ``generate``, gradient checkpointing
              on, torch's default threads; --trl-threads N pins them)
    tokens    builtin with ``batch.max_tokens_per_micro_batch=4096 batch.micro_batch_size=null`` (--tokens: a fixed
              budget instead of configs/user_job.yaml's derived one, ``auto``)
    vllm_tokens  vllm with the same token budget (--vllm --tokens)
    before    builtin through another checkout (--before PATH, e.g. the main branch's worktree): the same job
              on older code, in the same invocation

TRL is an optional bench dependency, never installed into the project's venv (it could move transformers or
torch); install it beside it and the bench finds it there::

    .venv/bin/python -m pip install --no-deps --target /tmp/trl-site trl accelerate datasets dill multiprocess \
        xxhash pandas python-dateutil pytz tzdata requests urllib3 idna certifi charset_normalizer six

(``--trl-site`` names another folder). Without it, the trl row says "not installed" and the rest runs.

Printed: one markdown table, median seconds per step over steps 5..N (the first steps pay for warm-up), the
phase breakdown of megatron_rl's steps (``timing/*`` metrics of ``metrics.jsonl``: rollout, old log-probs,
update, weight sync), the start-up (megatron_rl: from the launch to the first step, ``summary.txt``; TRL: from the
call to its first step, model load and trainer set-up included), the whole run's wall time (process start
included) and each system's ratio to TRL's median step. The numbers are from a shared 2-core CPU box unless said otherwise: run the systems side by side in
one invocation and compare only within it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = 8
SAMPLES = 8
MAX_NEW_TOKENS = 16
LR = 1e-5
TOKEN_BUDGET = ("batch.micro_batch_size=null", "batch.max_tokens_per_micro_batch=4096")
NUMBERS = "one two three four five six seven eight nine ten".split()
REWARD_SOURCE = '''
def reward(prompt, response, answer, **_):
    """1 when the answer word is the first word of the response, 0.1 when it appears later, else 0."""
    words = response.split()
    return 1.0 if words[:1] == [answer] else (0.1 if answer in words else 0.0)
'''


def make_job(root: Path) -> dict[str, Path]:
    """The model folder, the prompts and the reward file of the job (no downloads)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from common import tiny_qwen3  # examples/common.py: random Qwen3 + word-level tokenizer

    model = tiny_qwen3(root / "model", head_dim=32)  # vLLM's CPU attention: head_dim >= 32
    rows = [{"prompt": f"what is {a} plus {b} ?", "answer": NUMBERS[i + j + 1]}
            for i, a in enumerate(NUMBERS[:4]) for j, b in enumerate(NUMBERS[:4]) if i + j + 1 < len(NUMBERS)]
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = root / "reward.py"
    reward.write_text(REWARD_SOURCE)
    return {"model": model, "prompts": prompts, "reward": reward}


def run_megatron_rl(job: dict[str, Path], out: Path, steps: int, engine: str, *, repo: Path = ROOT,
                    extra: tuple[str, ...] = ()) -> dict:
    """The main job through ``repo``'s run_megatron.sh, one process; per-step ``timing/*`` from its metrics.jsonl."""
    overrides = [*extra, 
        f"model.hf_path={job['model']}", f"data.train_files={job['prompts']}", f"reward.function={job['reward']}:reward",
        f"logging.output_dir={out}", f"job.num_steps={steps}", f"job.max_new_tokens={MAX_NEW_TOKENS}",
        f"batch.train_batch_size={PROMPTS}", f"batch.policy_mini_batch_size={PROMPTS}",
        f"job.n_samples_per_prompt={SAMPLES}", f"optimizer.lr={LR}", "checkpoint.save_interval=0",
        "logging.tensorboard=false", "logging.progress_bar=false", f"rollout.engine={engine}",
    ]
    env = {**os.environ, "NPROC": "1"}
    started = time.perf_counter()
    proc = subprocess.run(["bash", str(repo / "run_megatron.sh"), *overrides], env=env, capture_output=True,
                          text=True, cwd=out.parent)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"megatron_rl ({engine}) failed, exit {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    startup = re.search(r"(\d+(?:\.\d+)?) s of start-up", (out / "summary.txt").read_text())
    return {"wall_s": wall, "steps": lines, "startup_s": float(startup.group(1)) if startup else None}


def run_trl(job: dict[str, Path], out: Path, steps: int, threads: int | None = None) -> dict:
    """TRL's GRPOTrainer on CPU on the same model, prompts and reward; step times from a callback. ``threads``:
    torch's intra-op threads (None: torch's default, TRL's own; on a loaded 2-core box two spinning OpenMP
    threads once made TRL's step ~10x slower)."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    namespace: dict = {}
    exec(REWARD_SOURCE, namespace)
    score = namespace["reward"]

    def reward_fn(prompts, completions, answer, **_):
        return [score(prompt=p, response=c, answer=a) for p, c, a in zip(prompts, completions, answer)]

    rows = [json.loads(line) for line in job["prompts"].read_text().splitlines()]
    dataset = Dataset.from_list(rows * ((steps * PROMPTS) // len(rows) + 1))
    times: list[float] = []
    first_step: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()
            first_step[:] = first_step or [self.t]

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    started = time.perf_counter()
    args = GRPOConfig(
        output_dir=str(out), use_cpu=True, max_steps=steps, learning_rate=LR, beta=0.0,
        per_device_train_batch_size=PROMPTS * SAMPLES, num_generations=SAMPLES, gradient_accumulation_steps=1,
        max_completion_length=MAX_NEW_TOKENS, temperature=1.0, report_to=[], save_strategy="no", logging_steps=1,
        lr_scheduler_type="constant", warmup_steps=0, seed=0, disable_tqdm=True,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(job["model"])
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimes()])
    trainer.train()
    return {"wall_s": time.perf_counter() - started, "step_s": times,
            "startup_s": first_step[0] - started if first_step else None}


def run_engine_alone(job: dict[str, Path], out: Path, steps: int) -> dict:
    """The vLLM engine the job would start (``ServeOptions`` as ``inference/vllm/launcher.py`` derives them for
    this model on CPU), answering one step's requests per step: the prompts (the job's chat-formatted ids) x n=8,
    16 tokens, temperature 1, concurrently, one request per prompt."""
    import concurrent.futures as futures

    from transformers import AutoConfig, AutoTokenizer

    from megatron_rl.inference.engine import SamplingSpec
    from megatron_rl.inference.vllm.server import EngineServer, ServeOptions

    python = os.environ.get("MEGATRON_RL_ENGINE_PYTHON") or str(ROOT / ".venv-engine/bin/python")
    config = AutoConfig.from_pretrained(job["model"])
    options = ServeOptions(python=python, dtype="float32", max_model_len=config.max_position_embeddings, seed=0,
                           kv_cache_gib=1.0, gpu_memory_utilization=0.9)
    started = time.perf_counter()
    server = EngineServer.start(job["model"], options, token="bench", log_path=out / "engine.log")
    try:
        server.wait_ready(600)
        startup = time.perf_counter() - started
        tokenizer = AutoTokenizer.from_pretrained(job["model"])
        rows = [json.loads(line) for line in job["prompts"].read_text().splitlines()]
        spec = SamplingSpec(max_tokens=MAX_NEW_TOKENS, temperature=1.0)
        times = []
        with futures.ThreadPoolExecutor(PROMPTS) as pool:
            for step in range(steps):
                batch = [rows[(step * PROMPTS + i) % len(rows)]["prompt"] for i in range(PROMPTS)]
                prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                           if tokenizer.chat_template else tokenizer(p)["input_ids"] for p in batch]
                t = time.perf_counter()
                list(pool.map(lambda ip: server.sample(list(ip[1]), spec, seed=step * 1000 + ip[0] * SAMPLES,
                                                       n=SAMPLES, timeout_s=300), enumerate(prompts)))
                times.append(time.perf_counter() - t)
    finally:
        server.kill()
    return {"wall_s": time.perf_counter() - started, "step_s": times, "rollout_s": times, "startup_s": startup}


def median_from(values: list[float], first: int) -> float:
    """Median of steps ``first``..N (1-based), or of all when there are fewer."""
    tail = values[first - 1:] or values
    return statistics.median(tail) if tail else float("nan")


def summarize(name: str, result: dict, first: int) -> dict:
    if "step_s" in result:
        rollout = result.get("rollout_s")
        return {"system": name, "step": median_from(result["step_s"], first), "wall": result["wall_s"],
                "startup": result.get("startup_s"), "rollout": median_from(rollout, first) if rollout else None}
    steps = result["steps"]

    def col(key: str) -> float | None:
        values = [s[key] for s in steps if key in s]
        return median_from(values, first) if values else None

    return {"system": name, "step": col("timing/step_s"), "rollout": col("timing/rollout_s"),
            "old": col("timing/old_logprobs_s"), "update": col("timing/update_s"),
            "sync": col("timing/weight_sync_s"), "skipped": col("timing/old_logprobs_skipped"),
            "startup": result.get("startup_s"), "wall": result["wall_s"]}


def table(rows: list[dict], first: int, steps: int) -> str:
    trl = next((r["step"] for r in rows if r["system"] == "trl" and r.get("step")), None)

    def fmt(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [f"| system | median s / step (steps {first}-{steps}) | vs TRL | rollout | old log-probs | update | "
             "weight sync | start-up s | whole run s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['system']} | {r['error']} | | | | | | | |")
            continue
        ratio = f"{r['step'] / trl:.2f}x" if trl else "-"
        old = fmt(r.get("old"))
        if r.get("skipped"):
            old += " (skipped)"
        lines.append(f"| {r['system']} | {fmt(r['step'])} | {ratio} | {fmt(r.get('rollout'))} | {old} | "
                     f"{fmt(r.get('update'))} | {fmt(r.get('sync'))} | {fmt(r.get('startup'), 1)} | "
                     f"{r['wall']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--first", type=int, default=5, help="first step of the median (1-based)")
    parser.add_argument("--systems", default="builtin,trl", help="comma list of builtin, vllm, engine, trl")
    parser.add_argument("--vllm", action="store_true", help="add the vllm system")
    parser.add_argument("--tokens", action="store_true", help="add the tokens system (a token budget)")
    parser.add_argument("--before", help="add the before system: builtin through this checkout")
    parser.add_argument("--trl-site", default="/tmp/trl-site", help="folder TRL was installed into (--target)")
    parser.add_argument("--trl-threads", type=int, default=None,
                        help="torch threads of the TRL run (default: torch's own, TRL's default)")
    parser.add_argument("--out", help="write the summary rows as JSON here")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the systems this many times, alternating (round 1: a, b; round 2: a, b; ...): "
                             "each ratio to TRL is taken within its round, and their range is printed")
    args = parser.parse_args()
    systems = list(dict.fromkeys(  # each once (a system named twice would share its output folder)
        (["before"] if args.before else []) + [s for s in args.systems.split(",") if s]
        + (["tokens"] if args.tokens else []) + (["vllm"] if args.vllm else [])
        + (["vllm_tokens"] if args.vllm and args.tokens else [])))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_small_end_") as tmp:
        root = Path(tmp)
        job = make_job(root)
        for round_ in range(1, args.rounds + 1):
            load = os.getloadavg()[0]
            round_rows = [dict(run_system(system, job, root / f"out_{system}_{round_}", args), round=round_,
                               load=load) for system in systems]
            rows += round_rows
            print(f"round {round_} of {args.rounds} (1-minute load average {load:.1f} at its start):", flush=True)
            print(table(round_rows, args.first, args.steps), flush=True)
    if args.rounds > 1:
        print(ratio_ranges(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


def run_system(system: str, job: dict[str, Path], out: Path, args: argparse.Namespace) -> dict:
    """One system's run of the job; its summary row (or an error row when TRL is not installed)."""
    try:
        if system == "trl":
            if Path(args.trl_site).is_dir() and args.trl_site not in sys.path:
                sys.path.insert(0, args.trl_site)
            result = run_trl(job, out, args.steps, args.trl_threads)
        elif system == "before":
            result = run_megatron_rl(job, out, args.steps, "builtin", repo=Path(args.before).resolve())
        elif system == "engine":
            out.mkdir(parents=True, exist_ok=True)
            result = run_engine_alone(job, out, args.steps)
        elif system in ("tokens", "vllm_tokens"):
            engine = "vllm" if system == "vllm_tokens" else "builtin"
            result = run_megatron_rl(job, out, args.steps, engine, extra=TOKEN_BUDGET)
        else:
            result = run_megatron_rl(job, out, args.steps, system)
        row = summarize(system, result, args.first)
    except ImportError as exc:
        row = {"system": system, "error": f"not installed ({exc}); see the docstring"}
    print(f"{system}: done", flush=True)
    return row


def ratio_ranges(rows: list[dict]) -> str:
    """Per system: its median step's ratio to TRL's in the same round, min-max over the rounds; its start-up range."""
    trl = {r["round"]: r["step"] for r in rows if r["system"] == "trl" and r.get("step")}
    lines = ["| system | vs TRL, each round | range | start-up s, range |", "|---|---|---|---|"]
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system and r.get("step")]
        ratios = [r["step"] / trl[r["round"]] for r in mine if r["round"] in trl]
        starts = [r["startup"] for r in mine if r.get("startup") is not None]
        each = ", ".join(f"{x:.2f}x" for x in ratios) or "-"
        span = f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "-"
        start = f"{min(starts):.1f}-{max(starts):.1f}" if starts else "-"
        lines.append(f"| {system} | {each} | {span} | {start} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
