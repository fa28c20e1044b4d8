"""Run one trial as a child process group and say how it ended.

The controller never joins a process group itself: each trial is `torchrun` (one
agent, N ranks) started in a session of its own, given a wall-clock limit, and on
timeout killed with its whole process tree (torchrun starts each rank in a new
session, so killing torchrun's process group would miss them: the tree is walked
with psutil instead, and each rank also asks Linux to kill it if its parent dies).

Outcome, in the vocabulary of the design (section 3):

    rank 0 printed a result                       -> the result (complete, or pruned/oom over budget)
    any rank raised an out-of-memory error        -> pruned / oom        (never a crash)
    the wall-clock limit passed                   -> failed / timeout
    a rank died without a Python error            -> failed / crash      (signal or exit code)
    a rank raised a Python exception              -> failed / error      (its last lines kept)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from autotune.trialspec import ERROR_MARKER, RESULT_MARKER, TrialSpec

TAIL_LINES = 30
# torchrun's failure report: "rank : 1 (local_rank: 1)" then "exitcode : -9 (pid: 123)"
_FAILURE = re.compile(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)", re.S)


def torchrun_command(spec: TrialSpec, nprocs: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
            "-m", "autotune.runtime.trial", "--spec", spec.to_json()]


def trial_env(spec: TrialSpec) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank: ranks share the CPU's cores
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def run_trial(spec: TrialSpec, nprocs: int, timeout_s: float, log_dir: Path | None = None) -> dict:
    """Launch the trial, wait at most timeout_s, and return its result or failure record.

    stdout and stderr go to files (in log_dir when given) so a chatty trial cannot
    fill a pipe and stall; the caller gets `stderr_tail` either way.
    """
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="autotune-trial-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_dir / "stdout.log", log_dir / "stderr.log"
    start = time.monotonic()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(torchrun_command(spec, nprocs), stdout=out, stderr=err, env=trial_env(spec),
                                start_new_session=True, preexec_fn=_die_with_parent)
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_tree(proc.pid)
            proc.wait()
        except BaseException:  # Ctrl-C or the controller's own failure: leave nothing running
            kill_tree(proc.pid)
            proc.wait()
            raise
    record = classify(out_path.read_text(errors="replace"), err_path.read_text(errors="replace"),
                      proc.returncode, timed_out, timeout_s)
    record["duration_s"] = time.monotonic() - start
    return record


def classify(stdout: str, stderr: str, returncode: int, timed_out: bool, timeout_s: float) -> dict:
    """Turn what the trial printed and how it exited into one outcome record."""
    tail = _tail(stderr)
    errors = [json.loads(line[len(ERROR_MARKER):]) for line in stderr.splitlines()
              if line.startswith(ERROR_MARKER)]
    results = [line[len(RESULT_MARKER):] for line in stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if results and not timed_out:
        result = json.loads(results[-1])
        if returncode != 0:  # every rank's figures were gathered; a rank failed while shutting down
            result["warning"] = f"a rank exited abnormally after the result (torchrun exit code {returncode})"
        return result
    oom = [e for e in errors if e.get("oom")]
    if oom:
        first = min(oom, key=lambda e: e["time"])
        return _failure("pruned", "oom", f"rank {first['rank']}: {first['type']}: {first['message']}", tail)
    if timed_out:
        return _failure("failed", "timeout", f"no result after {timeout_s:.0f} s; every process was killed", tail)
    reported = {e["rank"] for e in errors}
    for rank, code in _failed_ranks(stderr):
        if rank not in reported:  # died without a Python error: a signal or an explicit exit
            how = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
                else f"exit code {code}"
            return _failure("failed", "crash", f"rank {rank} died ({how})", tail)
    if errors:
        first = min(errors, key=lambda e: e["time"])
        return _failure("failed", "error", f"rank {first['rank']}: {first['type']}: {first['message']}", tail)
    return _failure("failed", "crash", f"the trial exited with code {returncode} and no result", tail)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant, collected before any is killed (a rank
    whose torchrun died first is re-parented and would no longer be found)."""
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _failed_ranks(stderr: str) -> list[tuple[int, int]]:
    """(rank, exit code) of the ranks torchrun saw fail, its root cause first: the ranks it
    lists under "Failures" are often the ones it stopped (SIGTERM) after the root cause."""
    before, _, root = stderr.rpartition("Root Cause (first observed failure):")
    pairs = _FAILURE.findall(root) + _FAILURE.findall(before)
    return [(int(rank), int(code)) for rank, code in pairs]


def _failure(status: str, reason: str, error: str, tail: str) -> dict:
    return {"status": status, "reason": reason, "error": error, "stderr_tail": tail}


def _tail(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith(ERROR_MARKER)]
    return "\n".join(lines[-TAIL_LINES:])


def _die_with_parent() -> None:
    import ctypes
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
