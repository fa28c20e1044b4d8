"""Run many layouts in one group of real gloo processes, for the numerics tests.

Starting a process costs seconds (importing torch), so the processes of each world size
are spawned once for the whole test session, and each call (a test's layouts, or any
module-level function) runs in a new process group on them, through the same
`autotune.runtime.trial.run` that `autotune trial` uses.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import queue
import tempfile
import time
import traceback

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


def _run_specs(specs: list[str], with_params: bool) -> list[dict]:
    """On every rank of a group: run each spec; the results (rank 0's are returned)."""
    from autotune.runtime.trial import run

    results = []
    for text in specs:
        keep: dict = {}
        result = run(TrialSpec.from_json(text), keep=keep)
        if with_params:
            params = gathered_parameters(keep["trainer"].model)
            result["params"] = {name: t.flatten().tolist() for name, t in sorted(params.items())}
        results.append(result)
        del keep
    return results


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
    return run_on_ranks(world_size, _run_specs, specs, with_params)[0]


# -- warm groups: spawned once per world size, a new process group per call -------------------

def _group_worker(rank: int, world_size: int, requests, replies) -> None:
    """Serve calls until told to stop: each in a new gloo process group over a FileStore of its
    own, the caller's environment, one thread; a call that raises sends its traceback and
    ends this process (the group is then replaced)."""
    import gc

    import torch
    import torch.distributed as dist

    while True:
        request = requests.get()
        if request is None:
            return
        store_path, env, fn, args = request
        os.environ.clear()
        os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
        torch.set_num_threads(1)
        try:
            dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                                    world_size=world_size)
            try:
                value = json.loads(json.dumps(fn(*args)))
            finally:
                dist.destroy_process_group()
        except BaseException:
            replies.put((rank, False, traceback.format_exc()))
            return
        gc.collect()
        replies.put((rank, True, value))


class _Group:
    def __init__(self, world_size: int):
        context = mp.get_context("spawn")
        self.world_size = world_size
        self.requests = [context.Queue() for _ in range(world_size)]
        self.replies = context.Queue()
        self.procs = [context.Process(target=_group_worker, args=(r, world_size, self.requests[r], self.replies),
                                      daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def call(self, fn, args: tuple, timeout_s: float = 1200) -> list:
        with tempfile.TemporaryDirectory() as tmp:
            for q in self.requests:
                q.put((os.path.join(tmp, "store"), dict(os.environ), fn, args))
            values, deadline = [None] * self.world_size, time.monotonic() + timeout_s
            for _ in range(self.world_size):
                while True:
                    try:
                        rank, ok, value = self.replies.get(timeout=1.0)
                        break
                    except queue.Empty:
                        dead = [p for p in self.procs if not p.is_alive()]
                        if dead or time.monotonic() > deadline:
                            raise RuntimeError(f"spawned group of {self.world_size}: "
                                               f"{'a rank died' if dead else 'timed out'}") from None
                if not ok:
                    raise RuntimeError(f"rank {rank} of a spawned group of {self.world_size} raised:\n{value}")
                values[rank] = value
            return values

    def close(self) -> None:
        for q in self.requests:
            q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


_GROUPS: dict[int, _Group] = {}


def run_on_ranks(world_size: int, fn, *args) -> list:
    """Call fn(*args) on each of `world_size` gloo ranks; every rank's (JSON-able) return value.

    fn must be a module-level function (the spawned processes import it by name). The
    processes are spawned once per world size and kept for the session (importing torch
    costs seconds a process); each call forms a new process group, and a call that fails
    replaces its group."""
    group = _GROUPS.get(world_size)
    if group is None or not all(p.is_alive() for p in group.procs):
        group = _GROUPS[world_size] = _Group(world_size)
    try:
        return group.call(fn, args)
    except BaseException:
        _GROUPS.pop(world_size, None)
        for p in group.procs:
            p.kill()
        raise


@atexit.register
def _close_groups() -> None:
    for group in _GROUPS.values():
        group.close()
    _GROUPS.clear()
