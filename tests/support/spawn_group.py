"""Run many layouts in one group of real gloo processes, for the numerics tests.

Starting a process costs seconds (importing torch and autotune: 3.6 s of CPU each), so
every rank is forked from a server process that has imported them once
(multiprocessing's forkserver), and the layouts run in warm ranks: `world_size`
processes kept from test to test (one group per world size), each call forming a new
gloo process group over a fresh FileStore and running every layout it compares through
the same `autotune.runtime.trial.run` that `autotune trial` uses, as autotune's own warm
pool does for sweeps (autotune/launch/pool.py: nothing a trial leaves changes the next one's
losses or peak memory, tests/test_pool.py). A call that fails on any rank, or outlives
its timeout, ends the group; the next call starts a fresh one. Profiled runs (they
measure memory) and `run_on_ranks`' probes (they measure memory or patch torch) run on
ranks started for the call.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import json
import os
import queue
import tempfile
import time
import traceback

import torch.multiprocessing as mp

from autotune.config import ModelConfig, load_model
from autotune.trialspec import TrialSpec


def gathered_parameters(model) -> dict | None:
    """{plain name: full fp32 tensor} of every parameter, gathered over every mesh dim, on
    rank 0 (None on the others).

    Each rank gathers the DTensor shards it holds (a collective: every rank calls this);
    pipeline stages hold different parameters, so the per-rank dicts are merged on rank 0,
    the one whose results the test reads."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from autotune.runtime.init import plain_name

    models = model if isinstance(model, (list, tuple)) else [model]
    mine = {}
    for part in models:
        for name, param in part.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            mine[plain_name(name)] = full.detach().float().cpu()
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    if everyone is None:
        return None
    merged = {}
    for d in everyone:
        merged.update(d)
    return merged


def destroy_mesh_groups(meshes) -> None:
    """Destroy the process groups a layout's mesh made, every one but the default group.

    A sweep's trial ends by destroying its default group, and every group with it; layouts
    run back to back in one group would otherwise keep every earlier layout's groups, each
    with three gloo threads: 109 groups and 328 threads a rank after the 11 layouts of one
    pp test, which doubled its context switches and slowed the process beside it."""
    import torch.distributed as dist

    from autotune.runtime.torch_compat import forget_process_groups

    groups = {id(group): group for mesh in [meshes.root, *meshes.named.values()] for group in mesh.get_all_groups()}
    for group in groups.values():
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    forget_process_groups()


def _run_specs(specs: list[str], with_params: bool) -> list[dict] | None:
    """Every spec on the current process group, in order; rank 0's results, None on the
    others (the same trial seen from another rank). Only rank 0 answers with the trained
    weights: every rank serialising a third of a million floats per layout through JSON
    cost 13% of a numerics module's CPU."""
    import torch.distributed as dist

    from autotune.runtime.trial import run

    results = []
    for text in specs:
        keep: dict = {}
        result = run(TrialSpec.from_json(text), keep=keep)
        params = gathered_parameters(keep["trainer"].model) if with_params else None
        if params is not None:
            result["params"] = {name: t.flatten().tolist() for name, t in sorted(params.items())}
        results.append(result)
        destroy_mesh_groups(keep["mesh"])
        del keep
        gc.collect()  # as autotune's pool ranks do between trials: a trial's cycles are not the next one's
    return results if dist.get_rank() == 0 else None


def _serve(rank: int, world_size: int, tasks, answers, environment: dict) -> None:
    """A warm rank: for each (fn, args, store path) on its queue, join a new gloo group, call
    fn(*args), answer (rank, True, value) or (rank, False, traceback), leave the group.

    `environment`: the test's, as a spawned process would inherit it (a forked one has the
    fork server's, from when it started)."""
    import gc

    import torch
    import torch.distributed as dist

    from autotune.runtime.torch_compat import forget_process_groups

    os.environ.clear()
    os.environ.update(environment, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    while (task := tasks.get()) is not None:
        fn, args, store_path = task
        try:  # joining fails too where a peer joined, ran and died first: answered, not a silent exit
            dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                                    world_size=world_size)
            answers.put((rank, True, json.loads(json.dumps(fn(*args)))))  # as a JSON file gave it back before
        except Exception:  # noqa: BLE001 - handed to the test, which fails with it
            answers.put((rank, False, traceback.format_exc()))
            return  # the group's other ranks may be stuck in a collective: the caller ends them all
        dist.barrier()
        dist.destroy_process_group()
        forget_process_groups()  # as autotune's pool ranks do between trials
        gc.collect()


class WarmGroup:
    """`world_size` ranks that run one call after another (_serve)."""

    def __init__(self, world_size: int):
        context = mp.get_context("forkserver")
        # What every rank imports, imported once by the server the ranks are forked from
        # (before it starts: the first group of the test run starts it). The server runs
        # nothing, so a forked rank holds no tensor and no thread a spawned one would not.
        context.set_forkserver_preload(["autotune.runtime.trial", "support.spawn_group"])
        self.world_size = world_size
        self.tasks = [context.Queue() for _ in range(world_size)]
        self.answers = context.Queue()
        self.processes = [context.Process(target=_serve, daemon=True,
                                          args=(rank, world_size, self.tasks[rank], self.answers, dict(os.environ)))
                          for rank in range(world_size)]
        for process in self.processes:
            process.start()
        self.directory = tempfile.TemporaryDirectory()
        self.calls = 0

    def call(self, fn, args: tuple, timeout_s: float) -> list:
        """fn(*args) on every rank; the values in rank order. Raises where a rank raised,
        died or did not answer within timeout_s (the caller then ends the group)."""
        self.calls += 1
        store = os.path.join(self.directory.name, f"store{self.calls}")
        for tasks in self.tasks:
            tasks.put((fn, args, store))
        values, deadline = {}, time.monotonic() + timeout_s
        while len(values) < self.world_size:
            try:
                rank, ok, value = self.answers.get(timeout=1.0)
            except queue.Empty:  # a rank that died (a crash, a signal) never answers: look each second
                dead = [r for r, p in enumerate(self.processes) if not p.is_alive() and r not in values]
                if dead and self.answers.empty():
                    time.sleep(1.0)  # a rank that raised answers, then exits: let its answer land first
                if self.answers.empty() and (dead or time.monotonic() > deadline):
                    raise RuntimeError(f"ranks {dead or 'all'} gave no answer "
                                       f"({'died' if dead else f'{timeout_s:.0f} s'})") from None
                continue
            if not ok:
                raise RuntimeError(self._failures(rank, value))
            values[rank] = value
        return [values[r] for r in range(self.world_size)]

    def _failures(self, rank: int, traceback_text: str, wait_s: float = 3.0) -> str:
        """What every failed rank said: the first to answer is often a victim (its peer's
        socket closed under it), so the others' answers, and the exit codes of ranks that
        died, are waited for a few seconds and reported with it."""
        said, deadline = {rank: traceback_text}, time.monotonic() + wait_s
        while time.monotonic() < deadline and any(p.is_alive() for r, p in enumerate(self.processes)
                                                  if r not in said):
            try:
                other, ok, value = self.answers.get(timeout=0.5)
            except queue.Empty:
                continue
            if not ok:
                said[other] = value
        while True:  # a rank that answered and then exited leaves its answer behind
            try:
                other, ok, value = self.answers.get_nowait()
            except queue.Empty:
                break
            if not ok:
                said.setdefault(other, value)
        died = {r: p.exitcode for r, p in enumerate(self.processes) if not p.is_alive() and r not in said}
        text = "\n".join(f"rank {r} raised:\n{said[r]}" for r in sorted(said))
        return text + "".join(f"\nrank {r} died (exit code {code})" for r, code in sorted(died.items()))

    def stop(self) -> None:
        """End the ranks' loops and wait for them (close kills)."""
        for tasks in self.tasks:
            tasks.put(None)
        self.close()

    def close(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout=10)
        self.directory.cleanup()


_GROUPS: dict[int, WarmGroup] = {}


def call_on_ranks(world_size: int, fn, args: tuple, fresh: bool = False, timeout_s: float = 600.0) -> list:
    """fn(*args) on the warm group of `world_size` ranks (started on first use), or with
    `fresh` on ranks started for this call alone; any failure ends the group, so the next
    call starts from fresh processes."""
    group = WarmGroup(world_size) if fresh else _GROUPS.get(world_size)
    if group is None:
        group = _GROUPS[world_size] = WarmGroup(world_size)
    try:
        values = group.call(fn, args, timeout_s)
    except BaseException:
        if group is _GROUPS.get(world_size):
            del _GROUPS[world_size]
        group.close()
        raise
    if fresh:
        group.stop()
    return values


@atexit.register
def _stop_groups() -> None:
    for group in _GROUPS.values():
        group.stop()
    _GROUPS.clear()


def run_layouts(world_size: int, layouts: list, model: str | ModelConfig = "tiny", steps: int = 3,
                warmup: int = 0, seed: int = 0, with_params: bool = False, profile: bool = False,
                **spec_fields) -> list[dict]:
    """Run each full layout string on `world_size` gloo ranks; rank 0's result per layout.

    A layout may also be (layout string, {TrialSpec field: value}) for fields of its own.
    with_params: each result also holds "params", {name: flat list} of the trained weights."""
    cfg = load_model(model) if isinstance(model, str) else model
    if not profile:  # what these compare is losses and weights: a given peak spares every rank of
        spec_fields.setdefault("peak_tflops", 1.0)  # every layout the calibration GEMMs (0.1-0.3 CPU-s)
    specs = []
    for layout in layouts:
        layout, own = (layout, {}) if isinstance(layout, str) else layout
        specs.append(TrialSpec(model=dataclasses.asdict(cfg), layout=layout, steps=steps, warmup=warmup, seed=seed,
                               profile=profile, **{**spec_fields, **own}).to_json())
    # A profiled run measures memory, and a warm process has made the few one-time
    # allocations a fresh one makes during its first steps: those run on fresh ranks.
    return call_on_ranks(world_size, _run_specs, (specs, with_params), fresh=profile)[0]


def run_on_ranks(world_size: int, fn, *args) -> list:
    """Call fn(*args) on each of `world_size` fresh gloo ranks; every rank's (JSON-able)
    return value, as JSON gives it back. The probes measure memory or patch torch for
    their test, so each call has processes of its own.

    fn must be a module-level function (the spawned processes import it by name)."""
    return call_on_ranks(world_size, fn, args, fresh=True)

