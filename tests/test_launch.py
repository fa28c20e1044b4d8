"""The launcher: outcomes classified from what the ranks print, and nothing left behind."""

import dataclasses
import json
import subprocess
import sys
import time

from autotune.config import load_model
from autotune.launch.launchers import KILL_WAIT_S, classify, run_trial
from autotune.trialspec import ERROR_MARKER, RESULT_MARKER, TrialSpec
from support.processes import gone

TORCHRUN_CRASH = """
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_08:00:00
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -11 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 11 (SIGSEGV) received by PID 4242
"""


def error_line(rank, oom=False, t=0.0, type_="RuntimeError", message="boom"):
    return ERROR_MARKER + json.dumps({"rank": rank, "type": type_, "oom": oom, "message": message, "time": t})


def test_classify_result():
    assert classify(RESULT_MARKER + '{"status": "complete"}\n', "", 0, False, 10) == {"status": "complete"}
    # A rank that aborts while shutting down, after rank 0 gathered every figure, keeps the result.
    late = classify(RESULT_MARKER + '{"status": "complete"}\n', TORCHRUN_CRASH, 1, False, 10)
    assert late["status"] == "complete" and "after the result" in late["warning"]


def test_classify_oom_wins_over_crash_and_error():
    stderr = "\n".join([error_line(0, t=2.0), error_line(2, oom=True, t=1.0, type_="OutOfMemoryError"),
                        TORCHRUN_CRASH])
    record = classify("", stderr, 1, False, 10)
    assert (record["status"], record["reason"]) == ("pruned", "oom")
    assert record["error"].startswith("rank 2: OutOfMemoryError")


def test_classify_signal_is_a_crash_even_when_others_raise():
    # rank 1 died by SIGSEGV; rank 0 then failed in a collective: a crash, not an error.
    record = classify("", error_line(0, message="Connection closed by peer") + "\n" + TORCHRUN_CRASH, 1, False, 10)
    assert (record["status"], record["reason"]) == ("failed", "crash")
    assert record["error"] == "rank 1 died (signal SIGSEGV)"


def test_classify_python_error_and_timeout():
    stderr = "Traceback...\nValueError: bad\n" + error_line(1, type_="ValueError", message="bad") + \
        TORCHRUN_CRASH.replace("-11", "1").replace("rank      : 1", "rank      : 1")
    record = classify("", stderr, 1, False, 10)
    assert (record["status"], record["reason"], record["error"]) == ("failed", "error", "rank 1: ValueError: bad")
    assert "ValueError: bad" in record["stderr_tail"]
    assert classify("", "", -9, True, 10)["reason"] == "timeout"


def test_timeout_kills_every_process(tmp_path):
    # A unique seed marks this trial's processes in the process table.
    seed = 987654321
    spec = TrialSpec(model=dataclasses.asdict(load_model("tiny")), layout="dp=2", steps=100000, seed=seed)
    spec.layout = "tp=1,pp=1,cp=1,ep=1,dp=2,dp_shard=2,zero=0,mbs=1,schedule=1f1b,vpp=1,recompute=none,sp=0"
    start = time.monotonic()
    record = run_trial(spec, 2, timeout_s=15, log_dir=tmp_path)
    assert (record["status"], record["reason"]) == ("failed", "timeout")
    # run_trial returns once the limit passed and the tree is killed (kill_tree waits up to
    # KILL_WAIT_S); what follows is reading two log files.
    assert time.monotonic() - start < 15 + KILL_WAIT_S + 10
    assert gone(f'"seed":{seed}')


def test_cli_trial_json_end_to_end():
    out = subprocess.run([sys.executable, "-m", "autotune", "trial", "--model", "tiny", "--gpus", "2",
                          "--layout", "mbs=2", "--steps", "2", "--warmup", "1", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # stdout is exactly one JSON document
    assert result["status"] == "complete" and result["world_size"] == 2 and result["grad_accum"] == 4
    assert len(result["losses"]) == 3 and result["tokens_per_s"] > 0


def test_cli_bad_input_is_one_line_and_exit_2():
    for args, field in ((["--model", "tiny", "--gpus", "3", "--layout", "tp=2"], "layout"),
                        (["--model", "tiny", "--gpus", "2", "--layout", "wat=1"], "layout.wat"),
                        (["--model", "nope", "--gpus", "2"], "model"),
                        (["--model", "tiny", "--gpus", "0"], "--gpus")):
        out = subprocess.run([sys.executable, "-m", "autotune", "trial", *args], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2, out
        assert len(out.stderr.strip().splitlines()) == 1 and field in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
