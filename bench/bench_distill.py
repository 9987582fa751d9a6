"""On-policy distillation vs RL from scratch at equal steps: the CPU arithmetic example, three seeds.

    .venv/bin/python bench/bench_distill.py [--steps 50] [--seeds 1,2,3] [--arms rl,distill,pure] \
        [--teacher outputs/arithmetic_cpu/hf/step_300] [--out bench/results/distill.json]

The job is configs/arithmetic_cpu.yaml (README: a random 2-layer Qwen3 learns "<d> plus one|two equals" -> the last
digit of the sum, 8 prompts x 8 samples a step, GRPO), each run through ``bash run_megatron.sh`` (two CPU ranks,
the example's defaults) from the same random initial checkpoint (``--model``; made with
examples/arithmetic/make_model.py, seed 0, when missing). Per seed, ``--steps`` steps of each arm:

    rl       RL from scratch: the example as it is
    distill  the documented one-liner (docs/DISTILLATION.md): the same plus
             ``distillation.teachers=[{name: rl300, hf_path: <teacher>}]``; the task reward is kept (coef 1)
    pure     pure distillation: the teacher and no reward function (``reward.function=``), every reward 0

The teacher (``--teacher``) is the same example trained 300 steps by RL (``CONFIG=configs/arithmetic_cpu.yaml bash
run_megatron.sh``, seed 1; its HF export ``hf/step_300``).

Measured: the example's own evaluation (``eval/*`` of metrics.jsonl: greedy answers to every prompt of
examples/arithmetic/val.jsonl; ``eval/pass_rate`` = exactly the right digit then stop, ``eval/reward_mean`` = the
reward function's mean) at every step (``eval.interval=1``; an evaluation takes ~0.05 s), reported at steps
10, 20, 30, 50 (``--report``), the first step whose eval reward reaches the teacher's (or "not within N"), and the
run's wall time (process start to exit; it depends on the machine's load, the rewards at a given step do not).
The pure arm has no reward function, so its training-time evaluation would report 0: it runs with
``eval.interval=0`` and its final export (``hf/step_N``) is evaluated afterwards: a one-step run of the same
example from that checkpoint with ``optimizer.lr=1e-30`` (the pre-flight refuses 0; the weights do not move) and
``eval.interval=1``, the example's own evaluation. Its row has the step-N numbers only; its wall time is the
training run's. The teacher's eval is read from the metrics.jsonl of the run that exported it (measured the same
way when that file is not there; ``--measure-teacher`` measures it anyway, a check of this evaluation).

Printed: one markdown table (the teacher's row first); ``--out`` writes every run's numbers as JSON.

**Two teachers, each good at one half of the prompts** (``--arms rl,routed,teacher_one,teacher_two``): every
run of these arms reads ``<work>/data/train.jsonl`` and ``val.jsonl``, the example's files (same rows, same order)
with a column ``op``, ``one`` or ``two``, from the prompt ("<d> plus one|two equals"); the reward ignores it:

    routed       both half teachers, each scoring the rows of its half:
                 ``distillation.teachers=[{name: one, hf_path: <A>, when: {op: one}}, {name: two, hf_path: <B>,
                 when: {op: two}}]``; the task reward kept (coef 1)
    teacher_one  teacher A alone, given every row (``[{name: one, hf_path: <A>}]``); teacher_two: B alone

Teacher A is the example trained by RL on the "plus one" rows only (``data.train_files`` = those 10 rows,
``<work>/data/train_one.jsonl``), teacher B on the "plus two" rows only, ``--half-teacher-steps`` steps each (seed 1,
evaluated on all 20 prompts every 25 steps); trained once into ``<work>/teacher_one|two`` and reused when their
export is there. Every run of these arms logs every evaluation's 20 answers (``logging.num_samples=20``:
samples.jsonl), from which the pass rate of each half is counted; the table gives the pass rate on all prompts
at the ``--report`` steps and each half's at the last step, with the teachers' rows first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "arithmetic_cpu.yaml"
ARMS = ("rl", "distill", "pure", "routed", "teacher_one", "teacher_two")
HALVES = ("one", "two")  # the ``op`` column the demo adds to the example's rows (``demo_data``)
SINGLE_TEACHER_ARMS = ("distill", "pure")  # the arms of --teacher (the full example's RL teacher)


def run_job(out: Path, overrides: list[str]) -> dict:
    """One run of the example through run_megatron.sh into ``out``; its metrics.jsonl rows and wall time."""
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, not a resume of an earlier one
    env = {**os.environ, "CONFIG": str(CONFIG), "PY": sys.executable}
    args = ["bash", str(ROOT / "run_megatron.sh"), f"logging.output_dir={out}", "logging.progress_bar=false",
            "logging.tensorboard=false", *overrides]
    started = time.perf_counter()
    proc = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    (out.parent / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"run {out.name} failed (exit {proc.returncode}; {out.name}.log)\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"wall_s": wall, "rows": rows}


def evals(rows: list[dict]) -> dict[int, dict]:
    """step -> {"pass": eval/pass_rate, "reward": eval/reward_mean} of the steps that evaluated."""
    return {r["step"]: {"pass": r["eval/pass_rate"], "reward": r["eval/reward_mean"]}
            for r in rows if "eval/reward_mean" in r}


def evaluate_checkpoint(hf_path: Path, out: Path) -> dict:
    """The example's evaluation of an HF checkpoint: one step at lr 1e-30 (the pre-flight refuses 0; the weights
    do not move in float32), evaluated after it."""
    result = run_job(out, [f"model.hf_path={hf_path}", "seed=1", "job.num_steps=1", "optimizer.lr=1e-30",
                           "optimizer.lr_warmup_steps=0", "eval.interval=1", "checkpoint.save_interval=0"])
    return evals(result["rows"])[1]


def teacher_eval(teacher: Path, work: Path, measure: bool) -> dict:
    """The teacher's own eval: from the metrics.jsonl of the run that exported it when there, else measured."""
    if measure:
        return {**evaluate_checkpoint(teacher, work / "teacher_eval"), "source": "measured (lr 1e-30 run)"}
    step = int(teacher.name.rsplit("_", 1)[-1]) if teacher.name.startswith("step_") else None
    metrics = teacher.parent.parent / "metrics.jsonl"
    if step is not None and metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        found = evals(rows).get(step)
        if found:
            return {**found, "source": str(metrics)}
    return {**evaluate_checkpoint(teacher, work / "teacher_eval"), "source": "measured (lr 1e-30 run)"}


def half_pass_rates(out: Path) -> dict[int, dict[str, float]]:
    """step -> {half: pass rate} of the evaluations in ``out/samples.jsonl`` (every answer logged:
    ``logging.num_samples=20``); the half of a prompt is its ``op`` ("<d> plus one|two equals")."""
    counts: dict[int, dict[str, list[int]]] = {}
    for line in (out / "samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["split"] != "eval":
            continue
        half = op_of(record["prompt"])
        passed = record["reward"] is not None and record["reward"] >= 1.0  # the example's eval.pass_threshold
        counts.setdefault(record["step"], {}).setdefault(half, []).append(int(passed))
    return {step: {h: sum(v) / len(v) for h, v in by.items()} for step, by in counts.items()}


def op_of(prompt: str) -> str:
    """The half of an arithmetic prompt: "one" for "<d> plus one equals", else "two"."""
    return "one" if " plus one " in prompt else "two"


def demo_data(work: Path) -> dict[str, Path]:
    """The example's train and val files with an ``op`` column (``<work>/data``), and each half's training rows:
    {"train": ..., "val": ..., "train_one": ..., "train_two": ...}."""
    folder = work / "data"
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for split in ("train", "val"):
        rows = [json.loads(line) for line in (ROOT / f"examples/arithmetic/{split}.jsonl").read_text().splitlines()
                if line.strip()]
        rows = [{**row, "op": op_of(row["prompt"])} for row in rows]
        files[split] = folder / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in rows))
        if split == "train":
            for half in HALVES:
                files[f"train_{half}"] = folder / f"train_{half}.jsonl"
                files[f"train_{half}"].write_text("".join(json.dumps(r) + "\n" for r in rows if r["op"] == half))
    return files


def half_teacher(half: str, steps: int, work: Path, data: dict[str, Path]) -> Path:
    """The example trained by RL on one half's training rows only (``<work>/teacher_<half>``; trained when its
    export is missing, else reused); its HF export."""
    out = work / f"teacher_{half}"
    export = out / "hf" / f"step_{steps}"
    if (export / "model.safetensors").exists():
        return export
    print(f"# training teacher {half} ({steps} steps on the 'plus {half}' rows)", file=sys.stderr, flush=True)
    run_job(out, ["seed=1", f"job.num_steps={steps}", f"data.train_files={data[f'train_{half}']}",
                  f"data.val_files={data['val']}", "eval.interval=25",
                  "logging.num_samples=20", "checkpoint.save_interval=0"])
    return export


def teacher_overrides(arm: str, teacher: Path, halves: dict[str, Path]) -> list[str]:
    """The ``distillation.teachers`` override of an arm ([] for rl)."""
    if arm in SINGLE_TEACHER_ARMS:
        return [f"distillation.teachers=[{{name: rl300, hf_path: {teacher}}}]"]
    if arm == "routed":
        entries = ", ".join(f"{{name: {h}, hf_path: {halves[h]}, when: {{op: {h}}}}}" for h in HALVES)
        return [f"distillation.teachers=[{entries}]"]
    if arm.startswith("teacher_"):
        half = arm.removeprefix("teacher_")
        return [f"distillation.teachers=[{{name: {half}, hf_path: {halves[half]}}}]"]
    return []


def run_arm(arm: str, seed: int, steps: int, model: Path, teacher: Path, work: Path,
            halves: dict[str, Path] | None = None, data: dict[str, Path] | None = None) -> dict:
    overrides = [f"model.hf_path={model}", f"seed={seed}", f"job.num_steps={steps}", "checkpoint.save_interval=0",
                 *teacher_overrides(arm, teacher, halves or {})]
    overrides.append("eval.interval=0" if arm == "pure" else "eval.interval=1")
    if arm == "pure":
        overrides.append("reward.function=")
    if halves:  # the two-teacher demo: rows with 'op'; every evaluation's answers, for each half's pass rate
        overrides += [f"data.train_files={data['train']}", f"data.val_files={data['val']}", "logging.num_samples=20"]
    out = work / f"{arm}_s{seed}"
    result = run_job(out, overrides)
    found = evals(result["rows"])
    if arm == "pure":
        found = {steps: evaluate_checkpoint(out / "hf" / f"step_{steps}", work / f"{arm}_s{seed}_eval")}
    train = [r["reward/mean"] for r in result["rows"] if "reward/mean" in r]
    return {"arm": arm, "seed": seed, "wall_s": result["wall_s"], "evals": found,
            "halves": half_pass_rates(out) if halves else None,
            "loop_s": sum(r.get("timing/step_s", 0.0) for r in result["rows"]),
            "train_reward_last10": sum(train[-10:]) / max(len(train[-10:]), 1)}


def first_reaching(evals_by_step: dict, target: float) -> int | None:
    return next((s for s in sorted(evals_by_step) if evals_by_step[s]["reward"] >= target - 1e-9), None)


def table(teacher: dict, runs: list[dict], report: list[int], steps: int) -> str:
    head = " | ".join(f"step {s}" for s in report)
    lines = [f"| run | seed | {head} | first step at the teacher's eval reward | wall s |",
             "|---|---|" + "---|" * len(report) + "---|---|",
             f"| teacher (RL, 300 steps) | 1 | {' | '.join('-' for _ in report[:-1])}"
             f"{' | ' if len(report) > 1 else ''}{teacher['pass']:.2f} / {teacher['reward']:.3f} at step 300 | - | - |"]
    for run in runs:
        if run.get("error"):
            lines.append(f"| {run['arm']} | {run['seed']} | failed: {run['error']} |")
            continue
        cells = []
        for s in report:
            e = run["evals"].get(s)
            cells.append("-" if e is None else f"{e['pass']:.2f} / {e['reward']:.3f}")
        if run["arm"] == "pure":
            first = "- (evaluated at the end only)"
        else:
            hit = first_reaching(run["evals"], teacher["reward"])
            first = f"not within {steps}" if hit is None else str(hit)
        lines.append(f"| {run['arm']} | {run['seed']} | {' | '.join(cells)} | {first} | {run['wall_s']:.0f} |")
    return "\n".join(lines)


def halves_table(teachers: dict[str, dict], teacher_steps: int, runs: list[dict], report: list[int],
                 steps: int) -> str:
    """The two-teacher demo: pass rate on all 20 prompts at the ``report`` steps, each half's at ``steps``."""
    head = " | ".join(f"step {s}" for s in report)
    lines = [f"| run | seed | {head} | 'plus one' at {steps} | 'plus two' at {steps} | wall s |",
             "|---|---|" + "---|" * len(report) + "---|---|---|"]
    for half, found in teachers.items():
        rates = found["halves"].get(teacher_steps, {})
        lines.append(f"| teacher {half} (RL on 'plus {half}' only, {teacher_steps} steps) | 1 | "
                     + " | ".join("-" for _ in report[:-1]) + (" | " if len(report) > 1 else "")
                     + f"{found['evals'][teacher_steps]['pass']:.2f} at step {teacher_steps} | "
                     + f"{rates.get('one', float('nan')):.2f} | {rates.get('two', float('nan')):.2f} | - |")
    for run in runs:
        if run.get("error"):
            lines.append(f"| {run['arm']} | {run['seed']} | failed: {run['error']} |")
            continue
        cells = ["-" if run["evals"].get(s) is None else f"{run['evals'][s]['pass']:.2f}" for s in report]
        rates = (run["halves"] or {}).get(steps, {})
        lines.append(f"| {run['arm']} | {run['seed']} | {' | '.join(cells)} | {rates.get('one', float('nan')):.2f} | "
                     f"{rates.get('two', float('nan')):.2f} | {run['wall_s']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--arms", default="rl,distill", help=f"comma list of {', '.join(ARMS)}")
    parser.add_argument("--report", default="10,20,30,50", help="steps whose eval the table shows")
    parser.add_argument("--teacher", default="outputs/arithmetic_cpu/hf/step_300",
                        help="the teacher of the distill and pure arms")
    parser.add_argument("--half-teacher-steps", type=int, default=150,
                        help="RL steps of each half teacher (routed, teacher_one, teacher_two arms)")
    parser.add_argument("--model", default="outputs/arithmetic_model", help="the student's initial checkpoint")
    parser.add_argument("--work", default="outputs/bench_distill", help="the runs' output folders")
    parser.add_argument("--measure-teacher", action="store_true",
                        help="evaluate the teacher by an lr 1e-30 run even when its run's metrics.jsonl is there")
    parser.add_argument("--out", help="write every run's numbers as JSON here")
    args = parser.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    single = any(a in SINGLE_TEACHER_ARMS for a in arms)
    demo = any(a in ("routed", "teacher_one", "teacher_two") for a in arms)
    if single and demo:
        parser.error("--arms: the one-teacher arms (distill, pure) and the two-teacher demo's (routed, "
                     "teacher_one, teacher_two) make different tables; run them separately")
    teacher, model, work = (Path(p).resolve() for p in (args.teacher, args.model, args.work))
    if not demo and not (teacher / "model.safetensors").exists():
        parser.error(f"--teacher {teacher}: no model.safetensors; train it first: CONFIG=configs/arithmetic_cpu.yaml "
                     "bash run_megatron.sh seed=1 (its export: outputs/arithmetic_cpu/hf/step_300)")
    if not model.exists():
        subprocess.run([sys.executable, str(ROOT / "examples/arithmetic/make_model.py"), str(model)], check=True)
    work.mkdir(parents=True, exist_ok=True)
    report = [int(s) for s in args.report.split(",") if int(s) <= args.steps]
    halves, data, teacher_result, half_results = None, None, None, {}
    if demo:
        data = demo_data(work)
        halves = {h: half_teacher(h, args.half_teacher_steps, work, data) for h in HALVES}
        for h in HALVES:
            out = work / f"teacher_{h}"
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
            half_results[h] = {"evals": evals(rows), "halves": half_pass_rates(out)}
            print(f"# teacher {h}: {half_results[h]['halves'].get(args.half_teacher_steps)}", file=sys.stderr,
                  flush=True)
    else:
        teacher_result = teacher_eval(teacher, work, args.measure_teacher)
        print(f"# teacher: {teacher_result}", file=sys.stderr, flush=True)
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for arm in arms:
            try:
                runs.append(run_arm(arm, seed, args.steps, model, teacher, work, halves, data))
            except RuntimeError as err:  # the other runs go on; the row says why (the run's log beside it)
                runs.append({"arm": arm, "seed": seed, "error": str(err).splitlines()[0]})
                print(err, file=sys.stderr, flush=True)
                continue
            print(f"# {arm} seed {seed}: {runs[-1]['evals'].get(args.steps)} "
                  f"{(runs[-1]['halves'] or {}).get(args.steps, '')} in {runs[-1]['wall_s']:.0f} s",
                  file=sys.stderr, flush=True)
    if demo:
        print(halves_table(half_results, args.half_teacher_steps, runs, report, args.steps))
    else:
        print(table(teacher_result, runs, report, args.steps))
    if args.out:
        Path(args.out).write_text(json.dumps({"steps": args.steps, "teacher": str(teacher),
                                              "teacher_eval": teacher_result, "half_teachers": half_results,
                                              "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
