"""Each sampler replayed against a real, measured sweep: tiny on 8 and 4 CPU processes,
the `quick` space, every layout measured once.

    .venv/bin/python benchmarks/tiny_sweeps.py [--seeds 20] [--no-write]

search_efficiency.py asks the same question on a synthetic landscape; this one uses
real measurements, small enough to take whole. For each GPU count it runs

    autotune run --model tiny --gpus N --space quick --sampler grid --exhaustive --out results/bench-tiny-Ngpus-quick

unless that folder already holds a finished sweep (5 to 6 minutes for 8 processes
and 3.5 to 4.5 for 4 on two cores, on the warm pool), then replays grid, random, tpe and model through the
shipped controller (replay.py), each launch answered with the sweep's own record of
that layout (trials/N/result.json, the figures and the outcome the trial returned),
under the question the sweep stored with its study (so the same comm threshold).

Which outcomes reach the target: only `complete` trials, as only they can be the
recommended layout. A layout the sweep measured as pruned/comm_bound (exposed
communication over the quick space's 90%), pruned/oom or failed is a launch without a
usable throughput: it costs a trial and reaches nothing, though the model sampler
still calibrates on a comm_bound trial's figures, as in a real sweep.

Reported: launched trials until a complete layout within 5% of the sweep's best; grid
and model are deterministic (model's first proposal is in space order, since the CPU's
peak FLOP/s is unknown before a trial measures it), random and TPE the median over
seeds. The claim checked at 4 processes: model reaches within 5% of grid's best in at
most half of grid's trials over the whole space.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import optuna
from replay import Replay
from results_section import machine, today, write_section

from autotune.config import load_model
from autotune.plan.layout import INT_KEYS, STR_KEYS, Layout
from autotune.plan.space import load_space, valid_layouts
from autotune.record import Question

ROOT = Path(__file__).resolve().parents[1]
GPUS = (8, 4)
WITHIN = 0.05
SAMPLERS = ("grid", "random", "tpe", "model")


def sweep_dir(gpus: int) -> Path:
    return ROOT / "results" / f"bench-tiny-{gpus}gpus-quick"


def finished(gpus: int) -> bool:
    """Every layout of the space has an outcome in the sweep's trials.csv."""
    path = sweep_dir(gpus) / "trials.csv"
    if not path.exists():
        return False
    with open(path) as f:
        done = [r for r in csv.DictReader(f) if r["status"] and r["reason"] != "interrupted"]
    return len(done) == len(valid_layouts(load_model("tiny"), gpus, load_space("quick")))


def run_sweep(gpus: int) -> float:
    """The whole space, measured (resumes a sweep that was interrupted); its wall seconds."""
    start = time.perf_counter()
    subprocess.run([str(Path(sys.executable).with_name("autotune")), "run", "--model", "tiny", "--gpus", str(gpus),
                    "--space", "quick", "--sampler", "grid", "--exhaustive", "--out", str(sweep_dir(gpus))],
                   check=True, cwd=ROOT)
    return time.perf_counter() - start


def load_sweep(folder: Path) -> tuple[Question, list[dict]]:
    """The sweep's question and its rows (trials.csv, each with its launch record)."""
    storage = f"sqlite:///{folder / 'study.db'}"
    study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
    question = Question(**study.user_attrs["question"])
    rows = []
    with open(folder / "trials.csv") as f:
        for row in csv.DictReader(f):
            layout = Layout(**{k: int(row[k]) for k in INT_KEYS}, **{k: row[k] for k in STR_KEYS})
            result = folder / "trials" / row["trial"] / "result.json"
            record = json.loads(result.read_text()) if result.exists() else None
            rows.append({**row, "layout": layout, "record": record})
    return question, rows


def replay_sweep(gpus: int, seeds: int) -> dict:
    question, rows = load_sweep(sweep_dir(gpus))
    unlaunched = [r for r in rows if r["record"] is None]
    if unlaunched:
        raise SystemExit(f"{sweep_dir(gpus)}: trial {unlaunched[0]['trial']} has no result.json "
                         f"({outcome(unlaunched[0])}); the replay needs every launch")
    complete = {str(r["layout"]): float(r["tokens_per_s"]) for r in rows if r["status"] == "complete"}
    best = max(complete, key=complete.get)
    target = (1 - WITHIN) * complete[best]
    layouts = valid_layouts(question.model_config, gpus, question.space_config, question.gpus_per_node)
    replay = Replay(layouts, {str(r["layout"]): r["record"] for r in rows})
    results, orders = {}, {}
    for sampler in SAMPLERS:
        deterministic = sampler in ("grid", "model")  # model: the estimator and what was measured, no draw
        runs = [replay.trials_to_target(dataclasses.replace(question, sampler=sampler, seed=seed), target, len(rows))
                for seed in range(1 if deterministic else seeds)]
        results[sampler] = [n for n, _ in runs]
        orders[sampler] = [t.user_attrs["layout"] for t in runs[0][1]]
    by_name = {str(r["layout"]): r for r in rows}
    swept = [str(r["layout"]) for r in sorted(rows, key=lambda r: int(r["trial"]))]
    return {"gpus": gpus, "rows": rows, "best": by_name[best], "within": sum(v >= target for v in complete.values()),
            "results": results, "seeds": seeds, "model_order": [by_name[name] for name in orders["model"]],
            "grid_is_sweep": orders["grid"] == swept[:len(orders["grid"])],
            "sweep_min": sum(float(r["duration_s"] or 0) for r in rows) / 60}


def summary(values: list) -> str:
    """One value, or the median with its range over seeds; '-' for a run that never got there."""
    reached = [v for v in values if v is not None]
    if len(values) == 1:
        return "-" if values[0] is None else str(values[0])
    text = f"{statistics.median(reached):g} ({min(reached)}-{max(reached)})" if reached else "-"
    return text + (f", {len(values) - len(reached)} never" if len(reached) < len(values) else "")


def outcome(row: dict) -> str:
    return row["status"] + (f"/{row['reason']}" if row["reason"] else "")


def figure(row: dict) -> str:
    """A trial in a sentence: its layout and tokens/s, or its outcome."""
    value = f"{float(row['tokens_per_s']):,.0f}" if row["status"] == "complete" else outcome(row)
    return f"{row['layout'].short()} ({value})"


def notes(s: dict) -> str:
    counts = {}
    for r in s["rows"]:
        counts[outcome(r)] = counts.get(outcome(r), 0) + 1
    text = (f"- {s['gpus']} processes: {', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}; the sweep's "
            f"trials took {s['sweep_min']:.1f} min; the grid replay proposes the sweep's own order: "
            f"{'yes' if s['grid_is_sweep'] else 'NO'}. The model sampler's trials: "
            f"{', '.join(figure(r) for r in s['model_order'])}.")
    if s["gpus"] == 4:
        model, grid, half = s["results"]["model"][0], s["results"]["grid"][0], len(s["rows"]) // 2
        ok = model is not None and model <= half
        text += (f" Claim, model within {WITHIN:.0%} of grid's best in at most half of grid's {len(s['rows'])} "
                 f"trials ({half}): **{'holds' if ok else 'fails'}** (model {summary([model])}, grid "
                 f"{summary([grid])}).")
    return text


def section(sweeps: list[dict], wall_s: float) -> str:
    lines = ["| processes | layouts | complete | within 5% of best | best layout | best tokens/s | "
             + " | ".join(SAMPLERS) + " |", "|---:|---:|---:|---:|---|---:|" + "---:|" * len(SAMPLERS)]
    for s in sweeps:
        complete = sum(r["status"] == "complete" for r in s["rows"])
        lines.append(f"| {s['gpus']} | {len(s['rows'])} | {complete} | {s['within']} | {s['best']['layout'].short()} "
                     f"| {float(s['best']['tokens_per_s']):,.0f} | "
                     + " | ".join(summary(s["results"][name]) for name in SAMPLERS) + " |")
    return f"""## Samplers on real CPU sweeps (`tiny_sweeps.py`)

tiny, `quick` space, every layout measured once by `autotune run --sampler grid` (the
truth), then each sampler replayed through the shipped controller, each launch answered
by the sweep's record of that layout. Launched trials until a `complete` layout within
{WITHIN:.0%} of the sweep's best (a comm_bound, oom or failed layout costs a trial and reaches
nothing); grid and model are deterministic, random and TPE the median (range) over
{sweeps[0]['seeds']} seeds. {today()}, {machine()}; the replays took {wall_s:.0f} s.

{chr(10).join(lines)}

{chr(10).join(notes(s) for s in sweeps)}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for gpus in GPUS:
        if not finished(gpus):
            print(f"measuring the whole space at {gpus} processes: {run_sweep(gpus) / 60:.1f} min", flush=True)
    start = time.perf_counter()
    sweeps = [replay_sweep(gpus, args.seeds) for gpus in GPUS]
    text = section(sweeps, time.perf_counter() - start)
    print(text)
    if not args.no_write:
        write_section("tiny_sweeps", text)


if __name__ == "__main__":
    main()
