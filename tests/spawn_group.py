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


def _worker(rank: int, world_size: int, store_path: str, specs: list[str], out_dir: str) -> None:
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
            results.append(run(TrialSpec.from_json(text)))
    except Exception:
        results.append({"status": "failed", "error": traceback.format_exc()})
        raise
    finally:
        if rank == 0:
            Path(out_dir, "results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run_layouts(world_size: int, layouts: list[str], model: str | ModelConfig = "tiny", steps: int = 3,
                warmup: int = 0, seed: int = 0, **spec_fields) -> list[dict]:
    """Run each full layout string on `world_size` gloo ranks; rank 0's result per layout."""
    cfg = load_model(model) if isinstance(model, str) else model
    specs = [TrialSpec(model=dataclasses.asdict(cfg), layout=layout, steps=steps, warmup=warmup, seed=seed,
                       **spec_fields).to_json() for layout in layouts]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world_size, os.path.join(tmp, "store"), specs, tmp),
                           nprocs=world_size, start_method="spawn")
        return json.loads(Path(tmp, "results.json").read_text())
