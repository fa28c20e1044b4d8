"""The estimator's time model against published runs, fitted on part and judged on the rest.

    .venv/bin/python benchmarks/time_model.py             # reads published_runs.csv, writes time_model.md
    .venv/bin/python benchmarks/time_model.py --no-write  # print the report only

Reads every row of published_runs.csv that is there and prices those it can: a row is
skipped, counted with its reason, where it did not run, gives no tokens/s, or names a
model, GPU or layout the estimator cannot take. The rows are split by row id, a fixed
split (`is_fit_row`: the CRC-32 of the id, even = fit): the free parameters are fitted
on the fit rows only and the report is on the others (held out).

Free parameters (`fit`): per GPU as published and precision group (bf16; fp8 and mxfp8
together), the fraction of the dense peak a large GEMM reaches (the hardware YAML's
compute_efficiency), by bisection so that the median predicted / published tokens/s of
the group's fit rows is 1; and the shared shape parameters of the time model
(SHAPE_GRID, Calibration's fields), by a coordinate search over a small grid that
minimises the median |log(predicted / published)| over all fit rows, refitting the
per-group fractions at each point. A held-out row whose group has no fit row is priced
at the prior fraction.

Per segment (dense / MoE x Ampere / Hopper / Blackwell) the report gives, on held-out
rows, the median |error| and the signed median of tokens/s/GPU (error = predicted /
published - 1), and the share of pairs ordered as measured: pairs of runs of one group
(`layout_group`: one model, GPU, GPU count, precision, sequence length, global batch,
framework and compile setting) that differ in layout and were measured more than 5%
apart, counted where at least one of the two is held out, and over all pairs.

Deterministic, no GPU; a minute or so (each grid point refits the fractions).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
import zlib
from pathlib import Path

import published_runs
from published_runs import EIGHT_BIT, HARDWARE, load_rows, row_layout, row_model

from autotune.config import GIB, load_hardware
from autotune.errors import UsageError
from autotune.estimate import default_calibration, estimate

OUT = Path(__file__).with_name("time_model.md")
PAIR_GAP = 0.05
ARCH = {"a100-80gb": "Ampere", "a100-64gb": "Ampere", "h100-80gb": "Hopper", "h100-96gb": "Hopper",
        "h200": "Hopper", "b200": "Blackwell", "b300": "Blackwell", "gb200": "Blackwell", "gb300": "Blackwell"}
# The time model's shared shape parameters (Calibration fields) and the values searched.
SHAPE_GRID: dict[str, tuple[float, ...]] = {}


def is_fit_row(row: dict) -> bool:
    return zlib.crc32(row["id"].encode()) % 2 == 0


def fit_group(row: dict) -> tuple[str, str]:
    return row["hardware"], "bf16" if row["priced_as"] not in EIGHT_BIT else "8-bit"


def layout_group(row: dict) -> tuple:
    return tuple(row[k] for k in ("model", "hardware", "gpus", "precision", "seq_len", "gbs", "framework", "compile"))


class Row:
    """One priceable row: its model, layout and hardware resolved once."""

    def __init__(self, row: dict):
        if row["hardware"] not in HARDWARE:
            raise UsageError(f"hardware: no preset for {row['hardware']}")
        self.row, self.id = row, row["id"]
        self.model = row_model(row)
        self.hardware = load_hardware(HARDWARE[row["hardware"]])
        self.layout = row_layout(row, self.model, self.hardware)
        self.measured = float(row["source_tokens_per_s_per_gpu"])
        self.group, self.fit = fit_group(row), is_fit_row(row)
        self.segment = ("MoE" if self.model.moe else "dense", ARCH.get(row["hardware"], "other"))

    def price(self, efficiencies: dict, shape: dict) -> float:
        hardware = dataclasses.replace(self.hardware, compute_efficiency=efficiencies)
        cal = dataclasses.replace(default_calibration("cuda", hardware, self.row["priced_as"]), **shape)
        e = estimate(self.model, self.layout, hardware, float(self.row["budget_gib"]) * GIB, calibration=cal,
                     device="cuda", dtype=self.row["priced_as"], grad_dtype=self.row["grad_dtype"])
        return e.tokens_per_s_per_gpu


def load(rows: list[dict]) -> tuple[list[Row], dict[str, int]]:
    """(the rows it can price, {reason: rows skipped})."""
    kept, skipped = [], {}
    for row in rows:
        reason = None
        if row.get("ran") != "1":
            reason = "did not run (out of memory in the source)"
        elif not row.get("source_tokens_per_s_per_gpu"):
            reason = "no tokens/s published"
        else:
            try:
                kept.append(Row(row))
            except (UsageError, SystemExit, ValueError, KeyError) as e:
                reason = f"cannot price: {str(e).split(':')[0]}"
        if reason:
            skipped[reason] = skipped.get(reason, 0) + 1
    return kept, skipped


def efficiencies_of(group: tuple[str, str], value: float | None, bf16: float | None) -> dict:
    out = {"bf16": bf16} if bf16 else {}
    if value:
        out.update(dict.fromkeys(EIGHT_BIT if group[1] == "8-bit" else (group[1],), value))
    return out


def fit_fractions(rows: list[Row], shape: dict) -> dict:
    """{(GPU, precision group): fraction}: bf16 first, since an 8-bit row's other compute runs at it."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        if r.fit:
            groups.setdefault(r.group, []).append(r)
    fitted: dict = {}
    for group in sorted(groups, key=lambda g: g[1] != "bf16"):
        bf16 = fitted.get((group[0], "bf16"))

        def ratio(value: float, members=groups[group], group=group, bf16=bf16) -> float:
            eff = efficiencies_of(group, value, bf16)
            return statistics.median(r.price(eff, shape) / r.measured for r in members)

        if ratio(1.0) < 1:
            fitted[group] = None
            continue
        low, high = 0.02, 1.0
        for _ in range(14):
            middle = (low + high) / 2
            low, high = (middle, high) if ratio(middle) < 1 else (low, middle)
        fitted[group] = round((low + high) / 2, 3)
    return fitted


def row_efficiencies(r: Row, fractions: dict) -> dict:
    return efficiencies_of(r.group, fractions.get(r.group), fractions.get((r.group[0], "bf16")))


def predictions(rows: list[Row], fractions: dict, shape: dict) -> dict[str, float]:
    return {r.id: r.price(row_efficiencies(r, fractions), shape) for r in rows}


def fit_loss(rows: list[Row], fractions: dict, shape: dict) -> float:
    predicted = predictions([r for r in rows if r.fit], fractions, shape)
    return statistics.median(abs(math.log(predicted[r.id] / r.measured)) for r in rows if r.fit)


def fit(rows: list[Row]) -> tuple[dict, dict, float]:
    """(fractions per group, shape parameters, the fit rows' loss)."""
    shape = {name: getattr(default_calibration("cuda"), name) for name in SHAPE_GRID}
    fractions = fit_fractions(rows, shape)
    best = fit_loss(rows, fractions, shape)
    for _ in range(2):
        for name, values in SHAPE_GRID.items():
            for value in values:
                trial = {**shape, name: value}
                trial_fractions = fit_fractions(rows, trial)
                loss = fit_loss(rows, trial_fractions, trial)
                if loss < best - 1e-4:
                    best, shape, fractions = loss, trial, trial_fractions
    return fractions, shape, best


def ordered_pairs(rows: list[Row], predicted: dict, held_only: bool) -> tuple[int, int]:
    """(pairs ordered as measured, pairs) among runs of one layout group measured > PAIR_GAP apart."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault(layout_group(r.row), []).append(r)
    right = total = 0
    for members in groups.values():
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                if a.layout == b.layout or (held_only and a.fit and b.fit):
                    continue
                if max(a.measured, b.measured) / min(a.measured, b.measured) - 1 <= PAIR_GAP:
                    continue
                total += 1
                right += (a.measured > b.measured) == (predicted[a.id] > predicted[b.id])
    return right, total


def segment_lines(rows: list[Row], predicted: dict) -> list[str]:
    lines = ["| segment | held-out rows | median abs error | signed median | ordered pairs (a held-out row) | "
             "ordered pairs (all) | fit rows |", "|---|---|---|---|---|---|---|"]
    segments = sorted({r.segment for r in rows})
    for segment in [*segments, ("all", "")]:
        members = [r for r in rows if segment == ("all", "") or r.segment == segment]
        held = [r for r in members if not r.fit]
        errors = [predicted[r.id] / r.measured - 1 for r in held]
        held_pairs, all_pairs = ordered_pairs(members, predicted, True), ordered_pairs(members, predicted, False)

        def share(p):
            return f"{p[0]} of {p[1]}" + (f" ({p[0] / p[1]:.0%})" if p[1] else "")
        med = f"{statistics.median(abs(e) for e in errors):.1%}" if errors else "-"
        signed = f"{statistics.median(errors):+.1%}" if errors else "-"
        lines.append(f"| {' '.join(segment).strip()} | {len(held)} | {med} | {signed} | {share(held_pairs)} | "
                     f"{share(all_pairs)} | {len(members) - len(held)} |")
    return lines


def report(rows: list[Row], skipped: dict, fractions: dict, shape: dict, loss: float, seconds: float) -> str:
    predicted = predictions(rows, fractions, shape)
    lines = ["# The time model against published runs", "",
             "Regenerate with `.venv/bin/python benchmarks/time_model.py` (deterministic, no GPU). "
             "Rows: benchmarks/published_runs.csv; fit on the rows whose id's CRC-32 is even, reported on the "
             f"others. Error = predicted / published tokens/s/GPU - 1. Pairs: runs of one group measured more "
             f"than {PAIR_GAP:.0%} apart that differ only in layout.", "",
             f"{len(rows)} rows priced ({sum(r.fit for r in rows)} fit, {sum(not r.fit for r in rows)} held out); "
             f"{sum(skipped.values())} skipped:", ""]
    lines += [f"- {n}: {reason}" for reason, n in sorted(skipped.items())] or ["- none"]
    lines += ["", "## Held-out figures per segment", "", *segment_lines(rows, predicted), "",
              "## Fitted parameters", "", f"Fit rows' median |log(predicted / published)|: {loss:.3f}.", "",
              "| GPU | precision | large-GEMM fraction of peak |", "|---|---|---|"]
    lines += [f"| {g} | {p} | {v if v is not None else 'none (too slow at the peak)'} |"
              for (g, p), v in sorted(fractions.items())]
    if shape:
        lines += ["", "| shape parameter | fitted |", "|---|---|"] + [f"| {k} | {v:g} |" for k, v in shape.items()]
    lines += ["", "## Rows", "", "| id | segment | split | layout | published | predicted | error |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.id} | {' '.join(r.segment)} | {'fit' if r.fit else 'held out'} | {r.layout.short()} | "
                     f"{r.measured:,.0f} | {predicted[r.id]:,.0f} | {predicted[r.id] / r.measured - 1:+.1%} |")
    lines += ["", f"Run time {seconds:.0f} s."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=published_runs.CSV)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    rows, skipped = load(load_rows(args.csv))
    fractions, shape, loss = fit(rows)
    text = report(rows, skipped, fractions, shape, loss, time.perf_counter() - start)
    print(text)
    if not args.no_write:
        OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
