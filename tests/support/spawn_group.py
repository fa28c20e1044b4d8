"""Run many layouts in one group of real gloo processes, for the numerics tests.

Starting a process costs seconds (importing torch), so each test spawns `world_size`
processes once and runs every layout it compares inside that one process group,
through the same `autotune.runtime.trial.run` that `autotune trial` uses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import traceback
from pathlib import Path

import torch.multiprocessing as mp

from autotune.config import ModelConfig, load_model
from autotune.trialspec import TrialSpec


def gathered_parameters(model) -> dict:
    """{plain name: full fp32 tensor} of every parameter, gathered over every mesh dim.

    Each rank gathers the DTensor shards it holds; pipeline stages hold different
    parameters, so the per-rank dicts are merged on all ranks."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from autotune.runtime.init import plain_name

    models = model if isinstance(model, (list, tuple)) else [model]
    mine = {}
    for part in models:
        for name, param in part.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            mine[plain_name(name)] = full.detach().float().cpu()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged = {}
    for d in everyone:
        merged.update(d)
    return merged


def _worker(rank: int, world_size: int, store_path: str, specs: list[str], out_dir: str,
            with_params: bool) -> None:
    import torch
    import torch.distributed as dist

    from autotune.runtime.trial import run

    torch.set_num_threads(1)
    os.environ["RANK"], os.environ["LOCAL_RANK"] = str(rank), str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    results = []
    try:
        for text in specs:
            keep: dict = {}
            result = run(TrialSpec.from_json(text), keep=keep)
            if with_params:
                params = gathered_parameters(keep["trainer"].model)
                result["params"] = {name: t.flatten().tolist() for name, t in sorted(params.items())}
            results.append(result)
    except Exception:
        results.append({"status": "failed", "error": traceback.format_exc()})
        raise
    finally:
        if rank == 0:
            Path(out_dir, "results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run_layouts(world_size: int, layouts: list, model: str | ModelConfig = "tiny", steps: int = 3,
                warmup: int = 0, seed: int = 0, with_params: bool = False, profile: bool = False,
                **spec_fields) -> list[dict]:
    """Run each full layout string on `world_size` gloo ranks; rank 0's result per layout.

    A layout may also be (layout string, {TrialSpec field: value}) for fields of its own.
    with_params: each result also holds "params", {name: flat list} of the trained weights."""
    cfg = load_model(model) if isinstance(model, str) else model
    specs = []
    for layout in layouts:
        layout, own = (layout, {}) if isinstance(layout, str) else layout
        specs.append(TrialSpec(model=dataclasses.asdict(cfg), layout=layout, steps=steps, warmup=warmup, seed=seed,
                               profile=profile, **{**spec_fields, **own}).to_json())
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world_size, os.path.join(tmp, "store"), specs, tmp, with_params),
                           nprocs=world_size, start_method="spawn")
        return json.loads(Path(tmp, "results.json").read_text())


def _function_worker(rank: int, world_size: int, store_path: str, out_dir: str, fn, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["RANK"], os.environ["LOCAL_RANK"] = str(rank), str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size)
    try:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(fn(*args)))
    finally:
        dist.destroy_process_group()


def run_on_ranks(world_size: int, fn, *args) -> list:
    """Call fn(*args) on each of `world_size` gloo ranks; every rank's (JSON-able) return value.

    fn must be a module-level function (the spawned processes import it by name)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_function_worker, args=(world_size, os.path.join(tmp, "store"), tmp, fn, args),
                           nprocs=world_size, start_method="spawn")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]
