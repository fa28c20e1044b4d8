"""The warm pool (autotune/launch/pool.py): a pooled trial measures what a fresh launch does, and a
failure of any kind leaves fresh processes for the next trial."""

import dataclasses

import pytest

from autotune.config import load_model
from autotune.launch.launchers import run_trial
from autotune.launch.pool import RankPool
from autotune.trialspec import TrialSpec

TINY = dataclasses.asdict(load_model("tiny"))


def spec(layout: str, steps: int = 2, warmup: int = 1) -> TrialSpec:
    return TrialSpec(model=TINY, layout=layout, steps=steps, warmup=warmup)


@pytest.fixture
def pool():
    made = RankPool()
    yield made
    made.kill()
    made.close()


def pids(pool: RankPool) -> list[int]:
    return [p.pid for p in pool.procs]


def test_a_pooled_trial_gives_a_fresh_trials_losses_and_peak_whatever_ran_before(pool, tmp_path):
    # Every kind of group and hook, one profiled step each at mbs=4 (2 to 4 micro-batches: at
    # mbs=1 a tp=2 step of tiny takes 1.8 s, most of it in its 16 micro-batches' collectives).
    for before in ("tp=2,sp=1,mbs=4", "pp=2,schedule=zbv,mbs=4", "cp=2,mbs=4", "dp=2,zero=3,mbs=4"):
        record = pool.run(spec(before, steps=1, warmup=0), 2, 300, tmp_path)
        assert record["status"] == "complete", (before, record)
    warm = pids(pool)
    for measured in ("dp=2,zero=1,mbs=2", "tp=2,sp=1,mbs=4"):  # each after all of those
        pooled = pool.run(spec(measured), 2, 300, tmp_path)
        fresh = run_trial(spec(measured), 2, 300)
        assert pooled["status"] == fresh["status"] == "complete", (pooled, fresh)
        assert pooled["losses"] == fresh["losses"], measured
        # within 0.5%: seen equal to 16 bytes of 7.9 MB (a fresh process makes a few small
        # one-time allocations during its first measured steps)
        assert pooled["peak_mem_bytes"] == pytest.approx(fresh["peak_mem_bytes"], rel=0.005), measured
        # How much sooner a pooled trial ends is benchmarks/trial_overhead.py's to measure: on
        # a loaded machine one trial's duration says little (a pooled one was seen 2 s slower).
    assert pids(pool) == warm and pool.trials_run == 6  # the same processes, torch already imported
    assert (tmp_path / "stdout.log").read_text().count("AUTOTUNE_RESULT") == 1


@pytest.mark.parametrize("fault, outcome", [
    ("crash rank=1 step=1 signal=SEGV", ("failed", "crash")),
    ("oom rank=0 step=1", ("pruned", "oom")),
])
def test_a_failed_trial_leaves_fresh_processes_for_the_next(pool, tmp_path, monkeypatch, fault, outcome):
    monkeypatch.setenv("AUTOTUNE_FAULT", f"{fault} match=zero=3")
    failed = pool.run(spec("dp=2,zero=3"), 2, 300, tmp_path / "a")
    assert (failed["status"], failed["reason"]) == outcome, failed
    assert pool.procs == []  # killed, every one
    after = pool.run(spec("dp=2,zero=0"), 2, 300, tmp_path / "b")
    assert after["status"] == "complete", after
    assert pool.trials_run == 1
