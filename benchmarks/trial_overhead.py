"""What a CPU trial spends outside its measured steps, at 2, 4 and 8 processes.

    .venv/bin/python benchmarks/trial_overhead.py [--repeat 3] [--steps 3] [--warmup 1] [--no-write]

A sweep pays for a trial's whole wall time but measures only its steps: process
start-up, torch's imports, process groups, building and initialising the model, the
calibration GEMM, warm-up, reading the profile back and tearing down are overhead.
Runs `autotune trial --model tiny --gpus N --layout dp=N,zero=0 --json` (the quick
space's steps and warm-up by default) --repeat times per N and splits each:

    command    wall time of the whole command, as a user running `autotune trial` sees it
    trial      the JSON's duration_s: the process group from launch to exit, what each
               trial of a sweep costs (the controller is already running)
    measured   the sum of the measured steps' times (step_times_s, slowest rank per step)
    warm-up    warmup x step_time_s: the JSON does not time the warm-up steps, so this
               takes them as long as a measured one (the first step is usually slower)
    rest       trial - measured - warm-up: launch, initialisation, profile read-back,
               teardown

Medians over the repeats; the overhead share is (trial - measured) / trial.

Then a sweep, as a user runs one (its trials on the warm pool of rank processes,
autotune/launch/pool.py): `autotune run --model tiny --gpus N --space quick --sampler grid
--trials T --steps 5 --warmup 2 --confirm 0`, and the share of its wall time spent
outside the measured steps of its trials (1 - the sum of every trial's measured steps /
the command's wall time; the controller's start-up, the estimator, every launch, warm-up
and read-back count as outside).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_section import machine, today, write_section

ROOT = Path(__file__).resolve().parents[1]
PROCESSES = (2, 4, 8)


def run_trial(gpus: int, steps: int, warmup: int) -> dict:
    command = [str(Path(sys.executable).with_name("autotune")), "trial", "--model", "tiny", "--gpus", str(gpus),
               "--layout", f"dp={gpus},zero=0", "--steps", str(steps), "--warmup", str(warmup), "--json"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    result = json.loads(done.stdout)
    if result["status"] != "complete":
        raise SystemExit(f"{' '.join(command)}: {result['status']}/{result['reason']}: {result.get('error')}")
    measured = sum(result["step_times_s"])
    warm = warmup * result["step_time_s"]
    return {"command": wall, "trial": result["duration_s"], "measured": measured, "warmup": warm,
            "rest": result["duration_s"] - measured - warm}


def run_sweep(gpus: int, trials: int, steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        command = [str(Path(sys.executable).with_name("autotune")), "run", "--model", "tiny", "--gpus", str(gpus),
                   "--space", "quick", "--sampler", "grid", "--trials", str(trials), "--steps", str(steps),
                   "--warmup", str(warmup), "--confirm", "0", "--out", out]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)}: exit {done.returncode}: {done.stderr[-2000:]}")
        results = [json.loads(p.read_text()) for p in Path(out, "trials").glob("*/result.json")]
    measured = sum(sum(r.get("step_times_s") or []) for r in results)
    per_trial = statistics.median(r["duration_s"] for r in results)
    return {"wall": wall, "trials": len(results), "measured": measured, "per_trial": per_trial,
            "outside": 1 - measured / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--sweep-trials", type=int, default=6, help="trials of each sweep (default 6)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    start = time.perf_counter()
    rows = []
    for gpus in PROCESSES:
        runs = [run_trial(gpus, args.steps, args.warmup) for _ in range(args.repeat)]
        for run in runs:
            print(f"{gpus} processes: " + ", ".join(f"{k} {v:.2f} s" for k, v in run.items()), flush=True)
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        share = statistics.median((run["trial"] - run["measured"]) / run["trial"] for run in runs)
        rows.append(f"| {gpus} | {med['command']:.1f} | {med['trial']:.1f} | {med['measured']:.2f} | "
                    f"{med['warmup']:.2f} | {med['rest']:.1f} | {med['trial'] - med['measured']:.1f} | "
                    f"**{share:.0%}** |")
    sweeps = []
    for gpus in PROCESSES:
        sweep = run_sweep(gpus, args.sweep_trials, 5, 2)
        print(f"{gpus} processes, sweep: " + ", ".join(f"{k} {v:.2f}" for k, v in sweep.items()), flush=True)
        sweeps.append(f"| {gpus} | {sweep['trials']} | {sweep['wall']:.1f} | {sweep['per_trial']:.1f} | "
                      f"{sweep['measured']:.1f} | **{sweep['outside']:.0%}** |")
    text = f"""## Trial overhead on the CPU (`trial_overhead.py`)

Wall time of a trial outside its measured steps: `autotune trial --model tiny --gpus N
--layout dp=N,zero=0 --steps {args.steps} --warmup {args.warmup} --json` (the quick space's steps),
median of {args.repeat} runs per N, seconds. `trial` is the JSON's duration_s (the process group
from launch to exit: what a sweep pays per trial); `measured` the sum of the measured steps;
`warm-up` {args.warmup} x step_time_s (the JSON does not time warm-up steps); `rest` launch,
initialisation, profile read-back and teardown. {today()}, {machine()}; {(time.perf_counter() - start) / 60:.1f} min.

| processes | command | trial | measured | warm-up | rest | overhead (trial - measured) | overhead share of the trial |
|---:|---:|---:|---:|---:|---:|---:|---:|
{chr(10).join(rows)}

A sweep on the warm pool: `autotune run --model tiny --gpus N --space quick --sampler grid --trials
{args.sweep_trials} --steps 5 --warmup 2 --confirm 0`; `wall` the command's, `per trial` the median
trial's duration_s, `measured` the sum of every trial's measured steps, seconds.

| processes | trials | wall | per trial | measured | outside the measured steps |
|---:|---:|---:|---:|---:|---:|
{chr(10).join(sweeps)}
"""
    print(text)
    if not args.no_write:
        write_section("trial_overhead", text)


if __name__ == "__main__":
    main()
