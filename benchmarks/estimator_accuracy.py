"""Predicted vs measured peak memory of the CPU runtime, written to estimator_accuracy.md.

    .venv/bin/python benchmarks/estimator_accuracy.py
    .venv/bin/python benchmarks/estimator_accuracy.py --sweeps DIR [DIR ...]

Runs each layout on real gloo process groups (one group per world size), builds the
trainer exactly as a trial does (runtime/parallelize.py), trains `WARMUP` steps, then
measures one step: the bytes of live tensors on each rank, tracked at every aten op
and storage resize, starting from every tensor alive before the step. The measured
peak is the max over ranks, what a trial's `peak_mem_bytes` means on the CPU. The
prediction is `estimate(..., device="cpu").peak_mem_bytes`.

The layouts: plain data parallel at 1, 2 and 4 ranks, micro-batch sizes with gradient
accumulation, models whose memory is dominated by different terms (parameters and
optimizer, activations, the vocabulary's logits), context parallel at 2 and 4 ranks
(alone, with full recompute, with data and with tensor parallel, up to a 2048-token
sequence), MoE models with and without expert parallel (experts per ep rank, the
tokens dispatched to them, a shared expert), pipeline parallel with every schedule,
alone and with data parallel, tensor parallel and recompute, and PP composed with CP
and with EP. Extend LAYOUTS as the runtime gains dimensions. Target: median absolute
error <= 5%, worst <= 15%.

`--sweeps` reads finished sweeps instead (their trials.csv; tiny_sweeps.py makes two)
and runs nothing: predicted vs measured peak memory over every launched layout with a
measured peak (on the CPU the trial's profiler peak of live tensors), and the Spearman
rank correlation of predicted vs measured tokens/s over the complete trials, since the
model sampler needs the estimator's order more than its figures. It writes its own
section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import warnings
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from autotune.config import load_hardware, load_model, model_from_dict
from autotune.estimate import estimate
from autotune.layout import INT_KEYS, STR_KEYS, resolve

WARMUP = 2
OUT = Path(__file__).with_name("estimator_accuracy.md")
TINY = dataclasses.asdict(load_model("tiny"))
TINY_MOE = dataclasses.asdict(load_model("tiny-moe"))
MODELS = {
    "tiny": TINY,
    "tiny-long": {**TINY, "name": "tiny-long", "seq_len": 512, "global_batch_size": 8},  # activations
    "tiny-vocab": {**TINY, "name": "tiny-vocab", "vocab_size": 8192},  # logits, embedding and head
    "tiny-wide": {**TINY, "name": "tiny-wide", "hidden_size": 256, "ffn_hidden_size": 1024,
                  "num_layers": 4},  # parameters and optimizer
    "tiny-2k": {**TINY, "name": "tiny-2k", "seq_len": 2048, "global_batch_size": 4},  # a long sequence
    "tiny-moe": TINY_MOE,  # 8 experts, top-2, every layer MoE
    "tiny-moe-long": {**TINY_MOE, "name": "tiny-moe-long", "seq_len": 256, "global_batch_size": 8},  # dispatched tokens
    "tiny-moe-wide": {**TINY_MOE, "name": "tiny-moe-wide", "hidden_size": 128, "ffn_hidden_size": 256, "num_layers": 4,
                      "moe": {**TINY_MOE["moe"], "num_experts": 16, "expert_ffn_hidden_size": 256,
                              "num_shared_experts": 1}},  # expert weights and their optimizer state
}
# (world size, model, layout)
LAYOUTS = [(1, model, f"mbs={mbs}") for model in ("tiny", "tiny-vocab", "tiny-wide") for mbs in (1, 4, 16)] + \
          [(1, "tiny-long", f"mbs={mbs}") for mbs in (1, 2, 8)] + \
          [(2, model, f"zero=0,mbs={mbs}") for model in ("tiny", "tiny-vocab", "tiny-wide") for mbs in (1, 8)] + \
          [(2, "tiny-long", "zero=0,mbs=4")] + \
          [(4, model, f"zero=0,mbs={mbs}") for model in ("tiny", "tiny-long", "tiny-wide") for mbs in (1, 2)] + \
          [(2, "tiny", "cp=2,mbs=1"), (2, "tiny-long", "cp=2,mbs=1"), (2, "tiny-long", "cp=2,mbs=4"),
           (2, "tiny-vocab", "cp=2,mbs=8"), (2, "tiny-wide", "cp=2,mbs=8"), (2, "tiny-2k", "cp=2,mbs=2"),
           (4, "tiny", "cp=4,mbs=16"), (4, "tiny-long", "cp=4,mbs=2"), (4, "tiny-long", "cp=4,mbs=2,recompute=full"),
           (4, "tiny-long", "cp=2,dp=2,zero=0,mbs=2"), (4, "tiny-long", "cp=2,tp=2,mbs=2"),
           (4, "tiny-2k", "cp=4,mbs=1")] + \
          [(1, model, f"mbs={mbs}") for model in ("tiny-moe", "tiny-moe-long", "tiny-moe-wide") for mbs in (1, 4)] + \
          [(2, model, layout) for model in ("tiny-moe", "tiny-moe-long", "tiny-moe-wide")
           for layout in ("zero=0,mbs=4", "ep=2,zero=0,mbs=1", "ep=2,zero=0,mbs=4")] + \
          [(2, "tiny-moe", "ep=2,zero=2,mbs=2"), (2, "tiny-moe-wide", "ep=2,zero=2,mbs=4")] + \
          [(4, model, layout) for model in ("tiny-moe", "tiny-moe-wide")
           for layout in ("ep=4,zero=0,mbs=1", "ep=4,zero=0,mbs=2", "ep=2,zero=0,mbs=2")] + \
          [(4, "tiny-moe-wide", "ep=2,tp=2,zero=0,mbs=2")]
# Pipeline parallel: every schedule at pp=2 on models dominated by different terms, pp=4,
# and PP with data parallel (zero 1-3), tensor parallel (with SP) and full recompute.
SCHEDULES = ["schedule=gpipe", "schedule=1f1b", "schedule=interleaved_1f1b,vpp=2", "schedule=zero_bubble,vpp=2",
             "schedule=zbv,vpp=2", "schedule=dualpipev,vpp=2"]
LAYOUTS += [(2, "tiny", f"pp=2,{schedule},mbs=1") for schedule in SCHEDULES] + \
           [(2, "tiny-long", f"pp=2,{schedule},mbs=1") for schedule in SCHEDULES[1::2]] + \
           [(2, "tiny-vocab", f"pp=2,{schedule},mbs={mbs}") for schedule, mbs in zip(SCHEDULES[::2], (2, 2, 4))] + \
           [(2, "tiny-wide", f"pp=2,{schedule},mbs=2") for schedule in SCHEDULES[1:4]] + \
           [(2, "tiny", "pp=2,schedule=1f1b,recompute=full,mbs=2")] + \
           [(4, "tiny", f"pp=4,{schedule},mbs={mbs}") for schedule, mbs in zip(SCHEDULES, (2, 1, 1, 1, 1, 1))] + \
           [(4, "tiny", text) for text in ("pp=2,dp=2,zero=1,schedule=interleaved_1f1b,vpp=2,mbs=1",
                                           "pp=2,dp=2,zero=2,schedule=1f1b,mbs=1",
                                           "pp=2,dp=2,zero=3,schedule=zero_bubble,vpp=2,mbs=1",
                                           "pp=2,tp=2,sp=1,schedule=1f1b,mbs=1",
                                           "pp=2,tp=2,sp=1,schedule=zbv,vpp=2,mbs=1",
                                           "pp=2,tp=2,recompute=full,schedule=gpipe,mbs=2")] + \
           [(4, "tiny-long", "pp=2,cp=2,schedule=1f1b,mbs=1"), (4, "tiny-moe", "pp=2,ep=2,zero=0,schedule=1f1b,mbs=1"),
            (4, "tiny-moe-long", "pp=2,ep=2,zero=0,schedule=interleaved_1f1b,vpp=2,mbs=1")]


def holds_data(t) -> bool:
    """A plain CPU tensor. Wrapper subclasses (DTensor) report a storage of their full
    logical size, but their bytes live in the local tensors they wrap (plain_tensors)."""
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and not is_traceable_wrapper_subclass(t)


def plain_tensors(t) -> list:
    """The plain tensors holding `t`'s data: itself, or a wrapper subclass's inner tensors.
    A dispatch mode sees a DTensor op, not the local ops it runs, so the local result is
    found through the DTensor it comes back in."""
    if not isinstance(t, torch.Tensor):
        return []
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [inner for name in names for inner in plain_tensors(getattr(t, name))]
    return [t] if holds_data(t) else []


class LiveBytes(TorchDispatchMode):
    """Bytes of live CPU storages: every aten op's outputs and every storage resize
    (FSDP2 frees and refills its unsharded parameters by resizing), each storage once,
    released when Python frees it."""

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.now = self.peak = 0

    def track(self, storage) -> None:
        key, size = storage._cdata, storage.nbytes()
        self.now += size - self.sizes.get(key, 0)
        self.peak = max(self.peak, self.now)
        if key not in self.refs:
            self.refs[key] = weakref.ref(storage, lambda _, key=key: self.release(key))
        self.sizes[key] = size

    def release(self, key: int) -> None:
        self.now -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)

    def track_alive(self) -> None:
        with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
            warnings.simplefilter("ignore", FutureWarning)
            alive = [obj for obj in gc.get_objects() if holds_data(obj)]
        for obj in alive:
            self.track(obj.untyped_storage())

    def __enter__(self):
        self.original_resize = torch.UntypedStorage.resize_

        def resize_(storage, size):
            out = self.original_resize(storage, size)
            self.track(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self.original_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            for plain in plain_tensors(t):
                self.track(plain.untyped_storage())
        return out


def measure(model: dict, layout_text: str) -> dict:
    """Peak bytes of live tensors over one training step after warm-up, max over ranks;
    and under expert parallel the step's token imbalance of its most unbalanced layer
    (max / mean tokens an ep rank received; the estimator assumes even routing)."""
    from autotune.runtime.data import micro_batches
    from autotune.runtime.mesh import mesh_for
    from autotune.runtime.parallel.ep import token_imbalance
    from autotune.runtime.parallelize import build_trainer
    from autotune.trialspec import TrialSpec

    cfg = model_from_dict(model)
    layout = resolve(layout_text, cfg, dist.get_world_size())
    mesh = mesh_for(layout, "cpu")
    spec = TrialSpec(model=model, layout=str(layout))
    trainer = build_trainer(cfg, layout, mesh, torch.device("cpu"), spec)
    dp_rank, grad_accum = mesh["dp"].get_local_rank(), layout.grad_accum(cfg)

    def step(s: int) -> None:
        trainer.step(micro_batches(spec.seed, s, dp_rank, layout.mbs, grad_accum, cfg.seq_len, cfg.vocab_size))

    for s in range(WARMUP):
        step(s)
    gc.collect()
    tracker = LiveBytes()
    tracker.track_alive()
    with tracker:
        step(WARMUP)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, tracker.peak)
    imbalance = token_imbalance(trainer.model, mesh, WARMUP)
    return {"peak": max(peaks), "imbalance": max(imbalance.values()) if imbalance else None}


def worker(rank: int, world_size: int, store_path: str, cases: list, out_path: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    measured = [measure(MODELS[model], layout) for model, layout in cases]
    if rank == 0:
        Path(out_path).write_text(json.dumps(measured))
    dist.barrier()
    dist.destroy_process_group()


def run_group(world_size: int, cases: list) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "measured.json")
        mp.start_processes(worker, args=(world_size, os.path.join(tmp, "store"), cases, out),
                           nprocs=world_size, start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> int:
    hardware = load_hardware("cpu")
    rows = []
    for world_size in sorted({w for w, _, _ in LAYOUTS}):
        cases = [(model, layout) for w, model, layout in LAYOUTS if w == world_size]
        for (model, text), result in zip(cases, run_group(world_size, cases)):
            cfg = model_from_dict(MODELS[model])
            layout = resolve(text, cfg, world_size)
            predicted = estimate(cfg, layout, hardware, device="cpu")
            measured = result["peak"]
            rows.append((world_size, model, layout, predicted, measured, result["imbalance"]))
            print(f"{world_size} {model:10s} {layout.short():24s} predicted {predicted.peak_mem_bytes:>12,.0f} "
                  f"measured {measured:>12,} error {predicted.peak_mem_bytes / measured - 1:+.4%}", flush=True)
    errors = [abs(p.peak_mem_bytes / m - 1) for *_, p, m, _ in rows]
    lines = [
        "# Estimator accuracy: peak memory on the CPU runtime",
        "",
        f"Regenerate with `.venv/bin/python benchmarks/estimator_accuracy.py`. "
        f"{datetime.date.today().isoformat()}, torch {torch.__version__}, Python {platform.python_version()}.",
        "Measured: max over ranks of the bytes of live tensors during one step after "
        f"{WARMUP} warm-up steps. Predicted: `estimate(..., device=\"cpu\")`.",
        "ep imbalance: under expert parallel, the measured step's max / mean tokens received by an ep rank "
        "in its most unbalanced layer. The estimator assumes even routing, so the rank that receives more "
        "holds more dispatched tokens than predicted.",
        "",
        f"**{len(rows)} layouts: median absolute error {statistics.median(errors):.4%}, "
        f"worst {max(errors):.4%}** (targets 5% and 15%).",
        "",
        "| ranks | model | layout | grad_accum | predicted bytes | measured bytes | error | predicted peak at "
        "| largest term | ep imbalance |",
        "|---:|---|---|---:|---:|---:|---:|---|---|---:|",
    ]
    for world_size, model, layout, p, measured, imbalance in rows:
        largest = max(p.memory, key=p.memory.get)
        where = p.peak_phase + (f", pp rank {p.worst_pp_rank}" if layout.pp > 1 else "")
        lines.append(f"| {world_size} | {model} | {layout.short()} | {p.grad_accum} | {p.peak_mem_bytes:,.0f} | "
                     f"{measured:,} | {p.peak_mem_bytes / measured - 1:+.4%} | {where} | {largest} | "
                     f"{'-' if imbalance is None else f'{imbalance:.3f}'} |")
    OUT.write_text("\n".join(lines) + "\n")
    print(f"median {statistics.median(errors):.4%}, worst {max(errors):.4%}; wrote {OUT}")
    return 0 if statistics.median(errors) <= 0.05 and max(errors) <= 0.15 else 1


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
`peak_mem_gb` (on the CPU the profiler's: live tensors at the start of the measured steps plus
the highest running sum of its allocation events, max over ranks), over every launched layout
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
    args = parser.parse_args()
    sys.exit(sweep_accuracy(args.sweeps) if args.sweeps else main())
