"""The trial half of gpu_check.sh: one-GPU trials of a 1.1B model in bf16 at layouts that
differ in memory, each held against the estimator, and a real out-of-memory; writes
benchmarks/GPU.md.

Why one GPU: NCCL cannot put two ranks on one device, and one device is what the check
is sure to have. What it shows that the CPU tests cannot:

- the CUDA allocator's peak (`torch.cuda.max_memory_allocated`, the trial's
  peak_mem_bytes) against the estimator's predicted peak, split where the two can be
  told apart: the state that lives across steps (the trial's resident memory against the
  estimator's params + master_params + grads + optimizer) and what a step adds on top
  (activations, logits, temporaries, overhead); and beside it what the caching allocator
  reserved (`torch.cuda.max_memory_reserved`, the figure torchtitan's benchmarks report);
- step time against the estimate, and MFU against the bf16 peak of the hardware preset
  and against a bf16 GEMM measured here (MFU_gemm = MFU x peak / GEMM FLOP/s: how far the
  step is from what this GPU's GEMMs reach);
- the kernels the profiler saw (names, and that one rank records no NCCL kernel);
- a memory budget below the model's need: a real OutOfMemoryError reported pruned/oom,
  after which a fresh trial measures the same peak again (nothing left behind).

`--dry-run` runs every step on the CPU with `tiny` and the cpu preset, so the script is
known to run end to end before a GPU is spent on it; its figures describe the CPU.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
GPU_MODEL = str(ROOT / "benchmarks" / "models" / "gpu-check-1b.yaml")
# Layouts that differ in memory: micro-batch 1 and 2, each recompute mode.
LAYOUTS = ["mbs=1", "mbs=2", "mbs=1,recompute=selective", "mbs=1,recompute=op", "mbs=2,recompute=full"]
STATE_TERMS = ("params", "master_params", "grads", "optimizer")
STEP_TERMS = ("gathered_params", "activations", "pipeline_buffers", "logits", "temporaries", "overhead")
PEAK_TOLERANCE = 0.10  # a predicted peak further off than this is a bug to find
STEPS, WARMUP = 3, 2
GIB = 2**30


def autotune(*args: str) -> dict:
    """One `python -m autotune ... --json` call; its JSON (or a failure record)."""
    done = subprocess.run([sys.executable, "-m", "autotune", *args, "--json"], capture_output=True, text=True,
                          cwd=ROOT)
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"status": "failed", "reason": "no JSON", "error": done.stderr.strip().splitlines()[-1:]}


class Check:
    """The run's setting and what it found, in the order the report lists them."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.device = "cpu" if dry_run else "cuda"
        self.model = "tiny" if dry_run else GPU_MODEL
        self.hardware = "cpu" if dry_run else "h200"
        self.failures: list[str] = []
        self.rows: list[dict] = []

    def common(self, layout: str) -> list[str]:
        return ["--model", self.model, "--gpus", "1", "--layout", layout, "--dtype", "bf16",
                "--hardware", self.hardware, "--device", self.device]

    def trial(self, layout: str, *extra: str) -> dict:
        print(f"== trial {layout} {' '.join(extra)}", flush=True)
        return autotune("trial", *self.common(layout), "--steps", str(STEPS), "--warmup", str(WARMUP), *extra)

    def estimate(self, layout: str) -> dict:
        return autotune("estimate", *self.common(layout))

    def expect(self, ok: bool, what: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            self.failures.append(what)


def measured_gemm_flops(device: str) -> tuple[float, str]:
    """bf16 GEMM FLOP/s measured here, with the trial's own calibration routine."""
    from autotune.runtime.peak_flops import gemm_flops
    n = 8192 if device == "cuda" else 512
    flops = gemm_flops(torch.device(device), torch.bfloat16, n)
    if device == "cuda":
        torch.cuda.empty_cache()
    return flops, f"{n}x{n} bf16"


def kernel_names(trace_dir: Path, device: str) -> collections.Counter:
    """GPU kernels (CPU operators in a dry run) in the trial's profiler trace, by name."""
    category = "kernel" if device == "cuda" else "cpu_op"
    counts: collections.Counter = collections.Counter()
    for trace in trace_dir.glob("*.json"):
        for event in json.loads(trace.read_text()).get("traceEvents", []):
            if event.get("cat") == category:
                counts[event.get("name", "")[:80]] += 1
    return counts


def measure_layouts(check: Check, gemm: float, trace_dir: Path) -> None:
    for i, layout in enumerate(LAYOUTS):
        extra = ("--trace", str(trace_dir)) if i == 0 else ()
        result, predicted = check.trial(layout, *extra), check.estimate(layout)
        complete = result.get("status") == "complete"
        check.expect(complete, f"{layout}: trial complete ({result.get('status')}/{result.get('reason')} "
                               f"{result.get('error', '')})")
        if not complete:
            continue
        terms = predicted["memory"]
        state = sum(terms[t] for t in STATE_TERMS)
        resident = max(result["resident_mem_bytes_per_rank"])
        peak, predicted_peak = result["peak_mem_bytes"], predicted["peak_mem_bytes"]
        row = {
            "layout": layout, "peak_gib": peak / GIB, "predicted_gib": predicted_peak / GIB,
            "peak_error": predicted_peak / peak - 1,
            "resident_gib": resident / GIB, "predicted_state_gib": state / GIB,
            "step_gib": (peak - resident) / GIB, "predicted_step_gib": (predicted_peak - state) / GIB,
            "step_s": result["step_time_s"], "predicted_step_s": predicted.get("step_time_s"),
            "tokens_per_s": result["tokens_per_s"], "mfu": result["mfu"],
            "mfu_gemm": result["mfu"] * result["peak_tflops"] * 1e12 / gemm,
            "peak_tflops": result["peak_tflops"], "comm_fraction": result["comm_fraction"],
            "reserved_gib": result["reserved_mem_bytes"] / GIB if result["reserved_mem_bytes"] is not None else None,
        }
        check.rows.append(row)
        check.expect(abs(row["peak_error"]) <= PEAK_TOLERANCE,
                     f"{layout}: predicted peak {row['predicted_gib']:.3f} GiB vs measured {row['peak_gib']:.3f} GiB "
                     f"({row['peak_error']:+.1%}, tolerance {PEAK_TOLERANCE:.0%})")
        check.expect(result["comm_fraction"] == 0, f"{layout}: no communication at one rank")
        # The allocator's reserve: on CUDA at least the live peak; the CPU's allocator caches nothing.
        check.expect(row["reserved_gib"] >= row["peak_gib"] if check.device == "cuda" else row["reserved_gib"] is None,
                     f"{layout}: reserved {row['reserved_gib']} GiB against the live peak {row['peak_gib']:.3f}")
        check.expect(result["device"] == check.device, f"{layout}: ran on {result['device']}")


def out_of_memory(check: Check) -> dict:
    """A budget a third of the need: pruned/oom; then the first layout again, same peak."""
    layout = LAYOUTS[1]
    need = check.estimate(layout)["peak_mem_bytes"]
    oom = check.trial(layout, "--memory-budget-gb", f"{need / 3 / GIB:.6f}")
    check.expect((oom.get("status"), oom.get("reason")) == ("pruned", "oom"),
                 f"budget {need / 3 / GIB:.3f} GiB: pruned/oom (got {oom.get('status')}/{oom.get('reason')}: "
                 f"{oom.get('error', '')})")
    again = check.trial(LAYOUTS[0])
    first = check.rows[0]["peak_gib"] if check.rows else None
    same = again.get("status") == "complete" and first is not None and \
        abs(again["peak_mem_bytes"] / GIB / first - 1) < 0.01
    check.expect(same, f"after the OOM, {LAYOUTS[0]} measures the same peak "
                       f"({again.get('peak_mem_bytes', 0) / GIB:.3f} vs {first or 0:.3f} GiB)")
    return {"budget_gib": need / 3 / GIB, "status": oom.get("status"), "reason": oom.get("reason"),
            "error": oom.get("error", "")}


def report(check: Check, gemm: float, gemm_what: str, kernels: collections.Counter, oom: dict) -> str:
    device = torch.cuda.get_device_name(0) if check.device == "cuda" else "CPU (dry run)"
    lines = ["# The CUDA path on a GPU" if not check.dry_run else
             "# gpu_check dry run on the CPU (figures of the CPU, not of a GPU)", "",
             f"- device: {device}", f"- torch {torch.__version__}, CUDA {torch.version.cuda}",
             f"- date: {datetime.date.today().isoformat()}",
             f"- model: {Path(check.model).stem}, bf16, one rank, {STEPS} measured steps after {WARMUP}",
             f"- measured GEMM: {gemm / 1e12:.1f} TFLOP/s ({gemm_what})", "",
             "## Peak memory: trial (allocator) against the estimator", "",
             "`reserved` is the caching allocator's reserved peak (`torch.cuda.max_memory_reserved`, the",
             "figure torchtitan's benchmarks report) and how far it is above the live peak; the estimator",
             "prices the live one.",
             "",
             "| layout | peak GiB | predicted | error | resident | predicted state | step adds | predicted "
             "| reserved |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in check.rows:
        reserved = f"{r['reserved_gib']:.3f} ({r['reserved_gib'] / r['peak_gib'] - 1:+.1%})" \
            if r["reserved_gib"] is not None else "-"
        lines.append(f"| {r['layout']} | {r['peak_gib']:.3f} | {r['predicted_gib']:.3f} | {r['peak_error']:+.1%} | "
                     f"{r['resident_gib']:.3f} | {r['predicted_state_gib']:.3f} | {r['step_gib']:.3f} | "
                     f"{r['predicted_step_gib']:.3f} | {reserved} |")
    lines += ["", "## Time", "", "| layout | step s | predicted s | tokens/s | MFU (preset peak) | MFU (GEMM) |",
              "|---|---|---|---|---|---|"]
    for r in check.rows:
        predicted = f"{r['predicted_step_s']:.3f}" if r["predicted_step_s"] else "-"
        lines.append(f"| {r['layout']} | {r['step_s']:.3f} | {predicted} | {r['tokens_per_s']:.0f} | {r['mfu']:.3f} | "
                     f"{r['mfu_gemm']:.3f} |")
    lines += ["", f"Peak TFLOP/s the MFU is against: {check.rows[0]['peak_tflops'] if check.rows else 0:.4g}.", "",
              "## Kernels the profiler saw (first layout, most frequent)", ""]
    lines += [f"- {name} x{count}" for name, count in kernels.most_common(15)]
    lines += ["", "## Out of memory", "",
              f"Budget {oom['budget_gib']:.3f} GiB: {oom['status']}/{oom['reason']}: {oom['error']}", "",
              "## Checks", ""]
    lines += [f"- FAIL {f}" for f in check.failures] or ["- every check passed"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every step on the CPU with tiny")
    parser.add_argument("--out", help="the report (default benchmarks/GPU.md; a temporary file in a dry run)")
    args = parser.parse_args(argv)
    check = Check(args.dry_run)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (--dry-run runs it on the CPU)", file=sys.stderr)
        return 2
    gemm, gemm_what = measured_gemm_flops(check.device)
    trace_dir = Path(tempfile.mkdtemp(prefix="gpu-check-trace-"))
    measure_layouts(check, gemm, trace_dir)
    kernels = kernel_names(trace_dir, check.device)
    nccl = sum(count for name, count in kernels.items() if name.lower().startswith("nccl"))
    check.expect(bool(kernels) and nccl == 0, f"profiler saw {sum(kernels.values())} events, {nccl} of NCCL")
    oom = out_of_memory(check)
    out = Path(args.out) if args.out else \
        (Path(tempfile.mkdtemp()) / "GPU.dry-run.md" if args.dry_run else ROOT / "benchmarks" / "GPU.md")
    out.write_text(report(check, gemm, gemm_what, kernels, oom))
    print(f"== wrote {out}; {'PASS' if not check.failures else f'FAIL ({len(check.failures)})'}")
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
