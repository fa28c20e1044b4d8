"""A warm pool of rank processes for a local sweep: a trial pays for its model and its
steps, not for Python's start-up and torch's imports.

A fresh local trial is torchrun plus N ranks, each importing torch: about 4.5 s of a tiny
trial before any work (benchmarks/trial_overhead.py). A pool keeps N processes
(runtime/pool_rank.py) and hands each trial to all of them; they form a new gloo process
group for it over a FileStore of the trial's own and destroy it after, so the controller
still never joins a process group. The trial's output goes to its own stdout.log and
stderr.log, as a fresh launch's does, and is classified by the same rules
(launch.classify).

After any failure (a rank's error, an out-of-memory error, a crash, a timeout) every
process of the pool is killed and the next trial starts a fresh pool: a failure never
leaves a process in an unknown state for the next trial. A trial pruned by its measured
peak is a result, not a failure: the ranks go on. torchrun and SLURM launches, and
`autotune trial`, keep a fresh launch per trial; so do the re-measurements at the end of a
sweep (remeasure.py), which are meant to be independent of what ran before.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from autotune.launch.launchers import classify, kill_tree, trial_env
from autotune.trialspec import DONE_MARKER, TrialSpec, dying_with

POLL_S = 0.05
# Environment that shapes a trial inside its ranks: a pool started under other values is replaced.
TRIAL_ENV = ("AUTOTUNE_FAULT", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def ends_with(path: Path, text: str) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - len(text)))
            return f.read().decode(errors="replace") == text
    except FileNotFoundError:
        return False


class RankPool:
    """N warm rank processes, started on first use and replaced after a failure."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.key: tuple | None = None
        self.folder = Path(tempfile.mkdtemp(prefix="autotune-pool-"))
        self.trials_run = 0  # by the current processes

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
        self.procs, self.key = [], None
        shutil.rmtree(self.folder, ignore_errors=True)

    def kill(self) -> None:
        for proc in self.procs:
            kill_tree(proc.pid)
            proc.wait()
        self.procs, self.key = [], None

    def ensure(self, nprocs: int, spec: TrialSpec) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        key = (nprocs, spec.device, tuple(os.environ.get(name) for name in TRIAL_ENV))
        if self.procs and self.key == key and all(p.poll() is None for p in self.procs):
            return
        self.kill()
        log = open(self.folder / "pool.log", "a")
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "autotune.runtime.pool_rank", "--rank", str(rank), "--world-size", str(nprocs)],
            stdin=subprocess.PIPE, stdout=log, stderr=log, text=True, env=trial_env(spec),
            start_new_session=True, preexec_fn=dying_with(os.getpid())) for rank in range(nprocs)]
        log.close()
        self.key, self.trials_run = key, 0

    def run(self, spec: TrialSpec, nprocs: int, timeout_s: float, log_dir: Path) -> dict:
        """launch.run_trial's contract, on the pool's processes."""
        self.ensure(nprocs, spec)
        log_dir.mkdir(parents=True, exist_ok=True)
        out_path, err_path = log_dir / "stdout.log", log_dir / "stderr.log"
        rank_logs = [(log_dir / f"rank{r}.stdout.log", log_dir / f"rank{r}.stderr.log") for r in range(nprocs)]
        for paths in rank_logs:  # a folder used before must not answer for this trial
            for path in paths:
                path.write_text("")
        store = self.folder / f"store-{uuid.uuid4().hex}"
        start = time.monotonic()
        try:
            for proc, (out, err) in zip(self.procs, rank_logs):
                proc.stdin.write(json.dumps({"spec": spec.to_json(), "store": str(store), "stdout": str(out),
                                             "stderr": str(err)}) + "\n")
                proc.stdin.flush()
            timed_out, dead = self._wait(rank_logs, start + timeout_s)
        except BaseException:  # Ctrl-C or the controller's own failure: leave nothing running
            self.kill()
            raise
        finally:
            store.unlink(missing_ok=True)
        codes = [(rank, proc.returncode) for rank, proc in enumerate(self.procs) if proc.returncode not in (None, 0)]
        if timed_out or dead:  # whatever failed, the next trial gets fresh processes
            self.kill()
        else:
            self.trials_run += 1
        stdout = "".join(p.read_text(errors="replace") for p, _ in rank_logs if p.exists())
        stderr = "".join(p.read_text(errors="replace") for _, p in rank_logs if p.exists())
        out_path.write_text(stdout)
        err_path.write_text(stderr)
        record = classify(stdout, stderr.replace(DONE_MARKER + "\n", ""), codes[0][1] if codes else 0, timed_out,
                          timeout_s, failed_ranks=codes)
        record["duration_s"] = time.monotonic() - start
        return record

    def _wait(self, rank_logs, deadline: float) -> tuple[bool, bool]:
        """Until every rank has written its done marker (False, False), one has exited
        (False, True), or the deadline passed (True, False)."""
        done = [False] * len(rank_logs)
        while True:
            for rank, (_, err) in enumerate(rank_logs):
                done[rank] = done[rank] or ends_with(err, DONE_MARKER + "\n")
            if all(done):
                return False, False
            if any(proc.poll() is not None for proc in self.procs):
                time.sleep(0.5)  # let the others report what they saw before they are killed
                for proc in self.procs:  # `any` stopped at the first exited: reap every one, so
                    proc.poll()          # a rank that died is seen beside one that exited after its error
                return False, True
            if time.monotonic() > deadline:
                return True, False
            time.sleep(POLL_S)
