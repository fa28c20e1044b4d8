"""Trial vs estimator peak memory on models the tests never see, written to estimator_accuracy.md.

    .venv/bin/python benchmarks/estimator_accuracy.py              # fp32, bf16, bf16-grads; five repeats
    .venv/bin/python benchmarks/estimator_accuracy.py --dtype bf16 --repeats 1
    .venv/bin/python benchmarks/estimator_accuracy.py --log OUTPUT  # reuse the peaks a run printed
    .venv/bin/python benchmarks/estimator_accuracy.py --sweeps DIR [DIR ...]
    .venv/bin/python benchmarks/estimator_accuracy.py --kinds       # the three precisions, two repeated

`--kinds` measures the attention kinds apart (KIND_CASES: MLA with an MoE, sliding
windows) into estimator_accuracy_kinds.md, so that a kind added to the runtime is
measured without rerunning the whole table.

Each case is measured as a user measures it: `autotune trial --json` in its own
processes, its `peak_mem_bytes` (the allocator's bytes of live tensors at their peak in
each measured step, least over the steps, max over ranks: docs/metrics.md), against
`autotune estimate --hardware cpu`'s `peak_mem_bytes` for the same model, layout and
`--dtype` (`bf16-grads`: `--dtype bf16 --grad-dtype bf16`, gradients kept and reduced in
bf16). The models (MODELS) are shaped unlike any preset or test model: odd widths,
GQA, a vocabulary large next to the hidden size, a long sequence, an MoE with a shared
expert. The layouts cover every dimension: DP with ZeRO 0-3 and HSDP, TP with and
without SP, PP under every schedule (with ZeRO 0-3), CP, EP, each recompute mode,
recompute_layers, and mbs > 1 with gradient accumulation, alone and composed.

Repeats: one layout per dimension (REPEATED) runs `--repeats` times (the accuracy run
is the first); the spread (max - min) / min of its peaks shows how reproducible a
trial's figure is. Targets: median |error| <= 2%, worst <= 8% in each dtype; spread
under 1%.

`--sweeps` reads finished sweeps instead (their trials.csv; tiny_sweeps.py makes two)
and runs nothing: predicted vs measured peak memory over every launched layout with a
measured peak, and the Spearman rank correlation of predicted vs measured tokens/s over
the complete trials, since the model sampler needs the estimator's order more than its
figures. It writes its own section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from autotune.config import load_hardware, model_from_dict
from autotune.estimate import estimate
from autotune.plan.layout import INT_KEYS, STR_KEYS, resolve

OUT = Path(__file__).with_name("estimator_accuracy.md")
OUT_KINDS = Path(__file__).with_name("estimator_accuracy_kinds.md")
STEPS, WARMUP = 3, 2
# The precisions measured: (--dtype, --grad-dtype) of each label.
PRECISIONS = {"fp32": ("fp32", None), "bf16": ("bf16", None), "bf16-grads": ("bf16", "bf16")}
MODELS = {
    # GQA 3:1, widths no preset has
    "u1": dict(name="u1", vocab_size=1000, hidden_size=96, num_layers=6, num_heads=6, num_kv_heads=2,
               ffn_hidden_size=256, seq_len=128, global_batch_size=8),
    # the vocabulary's logits and embedding dominate
    "u2": dict(name="u2", vocab_size=3000, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=4,
               ffn_hidden_size=384, seq_len=64, global_batch_size=8),
    # a long sequence: activations dominate (and CP has something to split)
    "ul": dict(name="ul", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4,
               ffn_hidden_size=160, seq_len=512, global_batch_size=4),
    # MoE: 4 experts, top-2, one shared expert
    "um": dict(name="um", vocab_size=500, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
               ffn_hidden_size=128, seq_len=64, global_batch_size=8,
               moe=dict(num_experts=4, top_k=2, expert_ffn_hidden_size=96, num_shared_experts=1)),
    # DeepSeek-style: MLA with query compression, values narrower than keys, an MoE with a
    # shared expert after a dense first layer
    "ua": dict(name="ua", vocab_size=700, hidden_size=96, num_layers=4, num_heads=6, num_kv_heads=6, attention="mla",
               mla=dict(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
               ffn_hidden_size=192, seq_len=64, global_batch_size=8,
               moe=dict(num_experts=4, top_k=2, expert_ffn_hidden_size=64, num_shared_experts=1, layers=[1, 2, 3])),
    # a GELU MLP and a 48-token window on every second layer of a 256-token sequence
    "uw": dict(name="uw", vocab_size=600, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
               ffn_hidden_size=192, mlp="gelu", seq_len=256, global_batch_size=4, sliding_window=48,
               sliding_window_layers=[0, 2]),
}
SCHEDULES = ["schedule=gpipe", "schedule=1f1b", "schedule=interleaved_1f1b,vpp=2", "schedule=zero_bubble,vpp=2",
             "schedule=zbv,vpp=2", "schedule=dualpipev,vpp=2"]
# (ranks, model, layout)
CASES = [
    (1, "u1", "mbs=1"), (1, "u1", "mbs=4"), (1, "u2", "mbs=2"), (1, "ul", "mbs=1"),
    (1, "u1", "recompute=selective,mbs=2"), (1, "u1", "recompute=op,mbs=2"), (1, "u1", "recompute=full,mbs=2"),
    (1, "u1", "recompute=full,recompute_layers=2,mbs=2"), (1, "um", "mbs=2"), (1, "um", "recompute=op,mbs=2"),
    (2, "u1", "dp=2,zero=0,mbs=2"), (2, "u1", "dp=2,zero=1"), (2, "u1", "dp=2,zero=2,mbs=2"), (2, "u2", "dp=2,zero=3"),
    (2, "u1", "tp=2"), (2, "u1", "tp=2,sp=1"), (2, "u2", "tp=2,sp=1,mbs=2"), (2, "ul", "cp=2"),
    (2, "ul", "cp=2,recompute=full"), (2, "um", "ep=2,mbs=2"), (2, "um", "ep=2,zero=3"),
    (2, "u1", "tp=2,sp=1,recompute=op"), (2, "um", "ep=2,mbs=2,recompute=op"),
    *[(2, "u1", f"pp=2,{schedule}") for schedule in SCHEDULES],
    (2, "u2", "pp=2,schedule=1f1b,mbs=2"), (2, "u1", "pp=2,schedule=1f1b,recompute=full,recompute_layers=1"),
    (4, "u1", "dp=4,zero=1,mbs=2"), (4, "u1", "dp=4,dp_shard=2,zero=3"), (4, "u2", "dp=4,zero=2"),
    (4, "u1", "tp=2,dp=2,zero=1"), (4, "u1", "tp=2,sp=1,pp=2,schedule=1f1b"),
    (4, "u1", "pp=2,dp=2,zero=1,schedule=interleaved_1f1b,vpp=2"), (4, "ul", "cp=2,tp=2"),
    (4, "ul", "cp=2,dp=2,zero=2"), (4, "u1", "pp=4,schedule=1f1b"), (4, "um", "ep=2,zero=1"),
    (4, "um", "ep=2,tp=2,sp=1"), (4, "um", "pp=2,ep=2,schedule=1f1b"),
    # FSDP stages under PP: torch's schedules reduce once a step, so a stage holds its whole gradients
    (4, "u1", "pp=2,dp=2,zero=2,schedule=1f1b,mbs=2"), (4, "u2", "pp=2,dp=2,zero=3,schedule=gpipe"),
    (4, "u1", "pp=2,dp=2,zero=2,schedule=interleaved_1f1b,vpp=2"), (4, "um", "pp=2,dp=2,zero=2,schedule=zbv,vpp=2"),
]
KIND_CASES = [
    (1, "ua", "mbs=2"), (1, "ua", "recompute=selective,mbs=2"), (2, "ua", "tp=2,sp=1"), (2, "ua", "ep=2,mbs=2"),
    (2, "ua", "dp=2,zero=3"), (2, "ua", "cp=2"), (2, "ua", "pp=2,schedule=1f1b"), (1, "uw", "mbs=1"),
    (1, "uw", "recompute=full,mbs=2"), (2, "uw", "cp=2"), (2, "uw", "tp=2,sp=1"), (2, "uw", "pp=2,schedule=1f1b"),
]
# One layout per dimension, measured --repeats times.
REPEATED = [(2, "u1", "dp=2,zero=0,mbs=2"), (2, "u1", "dp=2,zero=1"), (2, "u1", "dp=2,zero=2,mbs=2"),
            (2, "u2", "dp=2,zero=3"), (4, "u1", "dp=4,dp_shard=2,zero=3"), (2, "u1", "tp=2"),
            (2, "u1", "tp=2,sp=1"), (2, "u1", "pp=2,schedule=1f1b"), (2, "ul", "cp=2"), (2, "um", "ep=2,mbs=2"),
            (1, "u1", "recompute=full,mbs=2"), (2, "ua", "dp=2,zero=3"), (2, "ua", "ep=2,mbs=2")]


def model_file(folder: Path, name: str) -> Path:
    path = folder / f"{name}.yaml"
    if not path.exists():
        path.write_text(yaml.safe_dump(MODELS[name]))
    return path


def trial(folder: Path, ranks: int, model: str, layout: str, label: str) -> dict:
    """`autotune trial --json` for one case, as a user runs it."""
    dtype, grad_dtype = PRECISIONS[label]
    command = [sys.executable, "-m", "autotune", "trial", "--model", str(model_file(folder, model)),
               "--gpus", str(ranks), "--layout", layout, "--dtype", dtype, "--steps", str(STEPS),
               "--warmup", str(WARMUP), "--peak-tflops", "1", "--json"]
    command += ["--grad-dtype", grad_dtype] if grad_dtype else []
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    result = json.loads(done.stdout) if done.stdout.strip() else {}
    if result.get("status") != "complete":
        raise SystemExit(f"{model} {layout} {label}: trial {result.get('status')}: "
                         f"{result.get('reason') or done.stderr.strip()[-400:]}")
    return result


def predicted(ranks: int, model: str, layout: str, label: str):
    dtype, grad_dtype = PRECISIONS[label]
    cfg = model_from_dict({**MODELS[model], "dtype": dtype})
    return estimate(cfg, resolve(layout, cfg, ranks), load_hardware("cpu"), device="cpu", dtype=dtype,
                    grad_dtype=grad_dtype)


def logged_peaks(log: Path | None) -> dict[tuple, list[int]]:
    """Measured peaks a previous run printed ({(dtype, ranks, model, layout short): [peak,
    repeats...]}), so an interrupted or partly wrong run need not measure them again."""
    found: dict[tuple, list[int]] = {}
    last = None
    for line in (log.read_text().splitlines() if log else []):
        pattern = r"(fp32|bf16-grads|bf16) (\d+) (\S+) (.+?)\s+predicted\s+[\d,.]+ measured\s+([\d,]+) error"
        if match := re.match(pattern, line):
            last = (match[1], int(match[2]), match[3], match[4].strip())
            found[last] = [int(match[5].replace(",", ""))]
        elif (match := re.match(r"\s+repeats \[([\d, ]+)\]", line)) and last:
            found[last] = [int(p) for p in match[1].split(",")]
    return found


def main(dtypes: list[str], repeats: int, log: Path | None = None, cases: list = CASES, out: Path = OUT) -> int:
    from results_section import machine, today

    rows, spreads = [], []
    known = logged_peaks(log)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for dtype in dtypes:
            for ranks, model, layout in cases:
                guess = predicted(ranks, model, layout, dtype)
                logged = known.get((dtype, ranks, model, guess.layout.short()))
                measured = {"peak_mem_bytes": logged[0]} if logged else trial(folder, ranks, model, layout, dtype)
                error = guess.peak_mem_bytes / measured["peak_mem_bytes"] - 1
                rows.append((dtype, ranks, model, guess, measured, error))
                print(f"{dtype} {ranks} {model} {guess.layout.short():40s} predicted {guess.peak_mem_bytes:>12,.0f} "
                      f"measured {measured['peak_mem_bytes']:>12,} error {error:+.2%}", flush=True)
                if (ranks, model, layout) in REPEATED and repeats > 1 and dtype == dtypes[0]:
                    peaks = logged if logged and len(logged) == repeats else [measured["peak_mem_bytes"]] + [
                        trial(folder, ranks, model, layout, dtype)["peak_mem_bytes"] for _ in range(repeats - 1)]
                    spreads.append((dtype, ranks, model, guess.layout.short(), peaks))
                    print(f"    repeats {peaks}: spread {max(peaks) / min(peaks) - 1:.3%}", flush=True)

    kinds = cases is KIND_CASES
    command = ("`.venv/bin/python benchmarks/estimator_accuracy.py --kinds` (about 6 minutes on two cores: "
               "three precisions and the repeats). " if kinds else
               "`.venv/bin/python benchmarks/estimator_accuracy.py` (about 35 minutes on two cores: "
               "three precisions and the repeats). ")
    used = dict.fromkeys(model for _, model, _ in cases)
    lines = ["# Estimator accuracy: trial vs estimator peak memory" + (", MLA and sliding windows" if kinds else ""),
             "", "Regenerate with " + command + f"{today()}, {machine()}.", "",
             "Measured: `autotune trial --json`'s `peak_mem_bytes` (the allocator's live bytes at their peak in each "
             f"of {STEPS} measured steps after {WARMUP} warm-up steps, least over steps, max over ranks). "
             "Predicted: `autotune estimate --hardware cpu`'s. Models: "
             + "; ".join(f"`{n}` {json.dumps(MODELS[n])}" for n in used) + ".", ""]
    verdict = True
    for dtype in dtypes:
        errors = [abs(e) for d, *_, e in rows if d == dtype]
        verdict &= statistics.median(errors) <= 0.02 and max(errors) <= 0.08
        lines.append(f"**{dtype}: {len(errors)} layouts, median |error| {statistics.median(errors):.2%}, "
                     f"worst {max(errors):.2%}** (targets 2% and 8%).  ")
    if spreads:
        worst = max(max(p) / min(p) - 1 for *_, p in spreads)
        verdict &= worst < 0.01
        lines.append(f"**Repeats: {len(spreads)} layouts x {repeats} trials, worst spread {worst:.3%}** "
                     "(target under 1%).")
    lines += ["", "| dtype | ranks | model | layout | grad_accum | predicted bytes | measured bytes | error | "
              "predicted peak at | largest term |", "|---|---:|---|---|---:|---:|---:|---:|---|---|"]
    for dtype, ranks, model, guess, measured, error in rows:
        where = guess.peak_phase + (f", pp rank {guess.worst_pp_rank}" if guess.layout.pp > 1 else "")
        lines.append(f"| {dtype} | {ranks} | {model} | {guess.layout.short()} | {guess.grad_accum} | "
                     f"{guess.peak_mem_bytes:,.0f} | {measured['peak_mem_bytes']:,} | {error:+.2%} | {where} | "
                     f"{max(guess.memory, key=guess.memory.get)} |")
    if spreads:
        lines += ["", "## Repeats", "", "| dtype | ranks | model | layout | peaks (bytes) | spread |",
                  "|---|---:|---|---|---|---:|"]
        for dtype, ranks, model, layout, peaks in spreads:
            lines.append(f"| {dtype} | {ranks} | {model} | {layout} | {', '.join(f'{p:,}' for p in peaks)} | "
                         f"{max(peaks) / min(peaks) - 1:.3%} |")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0 if verdict else 1


def spearman(a, b) -> float:
    """Spearman's rank correlation: Pearson's of the ranks (no scipy)."""
    return a.rank().corr(b.rank())


def sweep_frame(folder: Path):
    """A sweep's trials.csv with the estimator's figures for each layout added:
    prior_* uncalibrated (the CPU priors at the sweep's median measured peak FLOP/s),
    fitted_* calibrated on all the sweep's trials at once."""
    import optuna
    import pandas as pd

    from autotune.estimate import calibrate

    storage = f"sqlite:///{folder / 'study.db'}"
    question = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0],
                                 storage=storage).user_attrs["question"]
    cfg = model_from_dict(question["model"])
    frame = pd.read_csv(folder / "trials.csv")
    frame.insert(0, "sweep", folder.name)
    layouts = [resolve(",".join(f"{k}={row[k]}" for k in INT_KEYS + STR_KEYS), cfg, question["gpus"])
               for _, row in frame.iterrows()]
    results = [folder / "trials" / str(n) / "result.json" for n in frame["trial"]]
    records = [json.loads(path.read_text()) if path.exists() else {} for path in results]  # {}: never launched
    cpu = dataclasses.replace(load_hardware("cpu"), peak_tflops=statistics.median(
        r["peak_tflops"] for r in records if r.get("peak_tflops")))
    outcomes = [{**record, "status": row["status"], "reason": row["reason"]}
                for record, (_, row) in zip(records, frame.iterrows())]
    fitted = calibrate(list(zip(layouts, outcomes)), cfg, cpu, device="cpu")
    prior = [estimate(cfg, layout, cpu, device="cpu") for layout in layouts]
    frame["prior_peak_mem_gb"] = [e.peak_mem_bytes / 2**30 for e in prior]
    frame["prior_tokens_per_s"] = [e.tokens_per_s for e in prior]
    frame["fitted_tokens_per_s"] = [estimate(cfg, layout, cpu, calibration=fitted, device="cpu").tokens_per_s
                                    for layout in layouts]
    return frame


def sweep_accuracy(folders: list[str]) -> int:
    """--sweeps: the estimator against the trials of finished sweeps.

    Memory as each sweep recorded it (predicted_peak_mem_gb: priced before the trial with
    the calibration fitted to the trials before it) and uncalibrated. Throughput rankings:
    as recorded (what the model sampler saw; none for the first trial, before the CPU's
    peak FLOP/s was measured), uncalibrated, and calibrated on all the sweep's trials."""
    import pandas as pd
    from results_section import machine, today, write_section

    trials = pd.concat([sweep_frame(Path(folder)) for folder in folders], ignore_index=True)
    trials = trials.dropna(subset=["peak_mem_gb"])  # launched, with a measured peak

    def errors(frame, column):
        return frame[column] / frame["peak_mem_gb"] - 1

    def median_worst(error) -> str:
        return f"{error.abs().median():.2%}, worst {error[error.abs().idxmax()]:+.2%}"

    lines = ["| sweep | launched | memory error as recorded: median abs, worst | uncalibrated | complete | "
             "Spearman as recorded | uncalibrated | calibrated on all trials |",
             "|---|---:|---|---|---:|---:|---:|---:|"]
    for sweep, group in trials.groupby("sweep", sort=False):
        done = group[group["status"] == "complete"]
        recorded = done.dropna(subset=["predicted_tokens_per_s"])
        lines.append(f"| {sweep} | {len(group)} | {median_worst(errors(group, 'predicted_peak_mem_gb'))} | "
                     f"{median_worst(errors(group, 'prior_peak_mem_gb'))} | {len(done)} | "
                     f"{spearman(recorded['predicted_tokens_per_s'], recorded['tokens_per_s']):.2f} "
                     f"(n={len(recorded)}) "
                     f"| {spearman(done['prior_tokens_per_s'], done['tokens_per_s']):.2f} "
                     f"| {spearman(done['fitted_tokens_per_s'], done['tokens_per_s']):.2f} |")
    recorded, prior = errors(trials, "predicted_peak_mem_gb"), errors(trials, "prior_peak_mem_gb")
    text = f"""## Estimator accuracy on the sweeps (`estimator_accuracy.py --sweeps`)

The estimator against every launched trial of the sweeps {', '.join(f'`{Path(f).name}`' for f in folders)}
(tiny, `quick` space, CPU; tiny_sweeps.py makes them). Measured peak memory: the trial's
`peak_mem_gb` (on the CPU the profiler's: each measured step's live tensors at its start plus
the highest running sum of its allocation events, the least over the steps, max over ranks;
docs/metrics.md), over every launched layout
whether complete or not. Predicted: as the sweep recorded it (`predicted_peak_mem_gb`, priced
with the calibration fitted to the trials before it) and uncalibrated. Throughput: Spearman rank
correlation of predicted vs measured tokens/s over the complete trials: as recorded (none for
the first trial, priced before the CPU's peak FLOP/s was measured), uncalibrated (the CPU priors
at the sweep's median measured peak FLOP/s), and calibrated on all the sweep's trials at once.
{today()}, {machine()}.

**{len(trials)} layouts: memory error as recorded median {median_worst(recorded)}; uncalibrated
median {median_worst(prior)}.**

{chr(10).join(lines)}
"""
    print(text)
    write_section("estimator_accuracy_sweeps", text)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweeps", nargs="+", metavar="DIR", help="read these sweeps' trials.csv; run nothing")
    parser.add_argument("--dtype", action="append", choices=list(PRECISIONS), help="default: all three")
    parser.add_argument("--repeats", type=int, default=5, help="trials of each REPEATED layout (default 5)")
    parser.add_argument("--log", type=Path, help="a previous run's output: reuse the peaks it measured")
    parser.add_argument("--kinds", action="store_true", help="MLA and sliding windows only (KIND_CASES), into "
                        f"{OUT_KINDS.name}")
    args = parser.parse_args()
    cases, out = (KIND_CASES, OUT_KINDS) if args.kinds else (CASES, OUT)
    sys.exit(sweep_accuracy(args.sweeps) if args.sweeps else main(args.dtype or list(PRECISIONS), args.repeats,
                                                                   args.log, cases, out))
