"""Faults, hangs, kills and bad input: each recorded for what it is, nothing lost.

docs/reliability.md lists each guarantee with the test here that proves it.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import psutil
import pytest

from support.processes import alive, gone

CLI = [sys.executable, "-m", "autotune"]


def cli(*args, env=None, timeout=300):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def trial_with_fault(fault: str, *extra):
    out = cli("trial", "--model", "tiny", "--gpus", "2", "--steps", "2", "--warmup", "1", "--json", *extra,
              env={"AUTOTUNE_FAULT": fault})
    return json.loads(out.stdout), out


@pytest.mark.parametrize("fault, status, reason, error", [
    ("crash rank=1 step=1 signal=SEGV", "failed", "crash", "rank 1 died (signal SIGSEGV)"),
    ("crash rank=0 step=2 exit=3", "failed", "crash", "rank 0 died (exit code 3)"),
    ("oom rank=1 step=1", "pruned", "oom", "rank 1: OutOfMemoryError: injected out-of-memory error"),
])
def test_each_fault_is_recorded_for_what_it_is(fault, status, reason, error):
    """An OOM is never a crash, and a crash never an OOM or a Python error."""
    record, out = trial_with_fault(fault)
    assert out.returncode == 1
    assert (record["status"], record["reason"]) == (status, reason), record
    assert record["error"].startswith(error), record["error"]


def test_a_hang_in_a_collective_times_out_and_leaves_no_process():
    marker = "--seed=424242"  # not a real option: the seed in the spec marks this trial's processes
    record, out = trial_with_fault("hang rank=1 step=1", "--seed", "424242", "--timeout", "15")
    assert (record["status"], record["reason"]) == ("failed", "timeout"), record
    assert gone('"seed":424242'), marker


SLOW_S = 2.0  # injected before every step of rank 1: far above a step's noise on a loaded machine


def test_a_slow_rank_completes_and_slows_the_step():
    """Rank 1 sleeps SLOW_S before each step, outside its own timed step; rank 0 waits for it
    inside its gradient all-reduce. What that guarantees, whatever else the machine does:
    rank 0 spends most of SLOW_S per step waiting, waiting counts as communication, and the
    step (a step ends when its slowest rank does) grows by about SLOW_S."""
    fast, _ = trial_with_fault("slow rank=1 seconds=0 match=no-such-layout")
    slow, _ = trial_with_fault(f"slow rank=1 seconds={SLOW_S}")
    assert fast["status"] == slow["status"] == "complete"
    steps = len(slow["step_times_s"])
    waiting = slow["comm_fraction_per_rank"][0] * sum(slow["step_times_s_per_rank"][0]) / steps
    assert waiting > SLOW_S / 2, slow["comm_fraction_per_rank"]
    assert slow["step_time_s"] > fast["step_time_s"] + SLOW_S / 2
    assert slow["comm_fraction_per_rank"][0] > slow["comm_fraction_per_rank"][1]


def sweep(out_dir, *args, env=None, timeout=600):
    # --max-comm-fraction 1: on a loaded CPU any layout may be comm-bound; these tests are about
    # faults, so the leaders are not re-measured (--confirm 0; test_study tests that).
    return cli("run", "--model", "tiny", "--gpus", "2", "--space", "quick", "--sampler", "grid", "--steps", "1",
               "--warmup", "0", "--max-comm-fraction", "1", "--confirm", "0", "--out", str(out_dir), *args,
               env=env, timeout=timeout)


def test_a_crashing_trial_never_stops_the_study(tmp_path):
    # The grid's second layout at 2 GPUs (dp=2, zero=0, mbs=2) crashes; the study goes on.
    out = sweep(tmp_path / "s", "--trials", "3",
                env={"AUTOTUNE_FAULT": "crash rank=1 step=0 signal=KILL match=dp=2,dp_shard=2,zero=0,mbs=2,"})
    assert out.returncode == 0, out.stderr
    frame = pd.read_csv(tmp_path / "s" / "trials.csv")
    assert list(zip(frame["status"], frame["reason"].fillna(""))) == [
        ("complete", ""), ("failed", "crash"), ("complete", "")]
    assert "rank 1 died (signal SIGKILL)" in frame["error"][1]


def test_sigint_stops_cleanly_and_the_next_run_resumes(tmp_path):
    out_dir = tmp_path / "s"
    args = CLI + ["run", "--model", "tiny", "--gpus", "2", "--space", "quick", "--sampler", "grid",
                  "--trials", "3", "--steps", "1", "--warmup", "0", "--max-comm-fraction", "1", "--confirm", "0",
                  "--out", str(out_dir)]
    # Trial 1 hangs, so the controller is surely inside a trial when Ctrl-C comes.
    env = {**os.environ, "AUTOTUNE_FAULT": "hang rank=0 step=0 match=dp=2,dp_shard=2,zero=0,mbs=2,"}
    # Ctrl-C as a terminal sends it, even where the test itself runs with SIGINT ignored
    # (a background job of a non-interactive shell), which the controller would inherit.
    controller = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while not (out_dir / "trials" / "1").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(5)  # the hung trial's ranks are up
    ranks = [p for p in psutil.Process(controller.pid).children(recursive=True)]
    assert ranks
    controller.send_signal(signal.SIGINT)
    stdout, stderr = controller.communicate(timeout=120)  # about 2 s on an idle machine
    assert controller.returncode == 130, stderr
    assert "interrupted" in stderr and "top layouts" in stderr  # the summary is printed
    psutil.wait_procs(ranks, timeout=30)
    assert not alive(ranks)
    frame = pd.read_csv(out_dir / "trials.csv")
    assert list(zip(frame["status"], frame["reason"].fillna(""))) == [("complete", ""), ("failed", "interrupted")]
    # Without the fault, the next run measures the interrupted layout and finishes the budget.
    again = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    frame = pd.read_csv(out_dir / "trials.csv")
    measured = frame[frame["reason"] != "interrupted"]
    assert len(measured) == 3 and (measured["status"] == "complete").all()
    assert not measured.duplicated(subset=["tp", "pp", "zero", "mbs", "sp"]).any()


def test_a_results_folder_that_cannot_be_written(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere: use a path under a file instead
        locked = tmp_path / "a-file"
        locked.write_text("")
        target = locked / "sweep"
    else:
        target = locked / "sweep"
    out = sweep(target, "--trials", "1")
    assert out.returncode == 2
    assert out.stderr.strip().startswith(f"autotune run: error: --out {target}: cannot write there")
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_corrupt_study_database_is_reported_and_kept(tmp_path):
    out_dir = tmp_path / "s"
    out_dir.mkdir()
    garbage = b"this is not a database" * 100
    (out_dir / "study.db").write_bytes(garbage)
    out = sweep(out_dir, "--trials", "1")
    assert out.returncode == 2
    assert "cannot open it" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert (out_dir / "study.db").read_bytes() == garbage


def test_an_unreachable_storage_is_one_line_without_the_password(tmp_path):
    out = sweep(tmp_path / "s", "--trials", "1", "--storage", "postgresql://alice:hunter2@127.0.0.1:1/nowhere")
    assert out.returncode == 2
    assert "cannot open it" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "hunter2" not in out.stderr and "alice:***@" in out.stderr


BAD_MODEL = "name: bad\nvocab_size: 256\nhidden_size: 64\nnum_layers: 4\nnum_heads: 8\nffn_hidden_size: 128\n" \
            "seq_len: 64\nglobal_batch_size: 16\n"


@pytest.mark.parametrize("case, args, message", [
    ("malformed yaml", ["--model", "{model}"], "malformed YAML"),
    ("unknown field", ["--model", "{model}"], "colour: unknown field"),
    ("wrong type", ["--model", "{model}"], "hidden_size: must be int, got str"),
    ("zero size", ["--model", "{model}"], "num_layers: must be a positive integer, got 0"),
    ("negative size", ["--model", "{model}"], "seq_len: must be a positive integer, got -64"),
    ("layout does not divide", ["--model", "tiny", "--gpus", "3", "--layout", "tp=2"], "must divide --gpus 3"),
    ("unknown schedule", ["--model", "tiny", "--gpus", "2", "--layout", "pp=2,schedule=wavy"],
     "layout.schedule: must be one of"),
    ("unknown preset", ["--model", "llama9"], "unknown preset 'llama9'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case, args, message):
    text = {"malformed yaml": BAD_MODEL + "moe: [1, 2\n", "unknown field": BAD_MODEL + "colour: blue\n",
            "wrong type": BAD_MODEL.replace("hidden_size: 64", "hidden_size: wide"),
            "zero size": BAD_MODEL.replace("num_layers: 4", "num_layers: 0"),
            "negative size": BAD_MODEL.replace("seq_len: 64", "seq_len: -64")}.get(case, BAD_MODEL)
    model = tmp_path / "m.yaml"
    model.write_text(text)
    args = [a.replace("{model}", str(model)) for a in args]
    command = "trial" if "--layout" in args else "run"
    if "--gpus" not in args:
        args += ["--gpus", "2"]
    out = cli(command, *args, "--out", str(tmp_path / "out")) if command == "run" else cli(command, *args)
    assert out.returncode == 2, out
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("args, message", [
    (["--gpus", "4", "--gpus-per-node", "8"], "--gpus-per-node: must be <= --gpus (4), got 8"),
    (["--gpus", "6", "--gpus-per-node", "4"], "--gpus-per-node: must divide --gpus (6)"),
    (["--gpus", "3", "--space", "quick", "--max-comm-fraction", "2"], "argument --max-comm-fraction"),
    (["--gpus", "7", "--space", "quick"], "space quick: no valid layout for tiny on 7 GPUs"),
    (["--gpus", "4", "--space", "nope"], "unknown search space 'nope'"),
])
def test_bad_sweep_options_are_one_line_and_exit_2(tmp_path, args, message):
    out = cli("run", "--model", "tiny", *args, "--out", str(tmp_path / "out"))
    assert out.returncode == 2, out
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr
