"""--launcher slurm: each trial one srun step in the current allocation.

There is no SLURM here: these tests check the command lines against the srun, squeue
and scancel invocations we expect, with stand-ins for those commands that record their
arguments (srun's step then waits, as a hung trial would).
"""

import dataclasses
import os
import stat
import sys

import psutil
import pytest

from autotune.config import load_model
from autotune.errors import UsageError
from autotune.launch.launchers import Launcher, run_trial, srun_command, trial_agents
from autotune.trialspec import TrialSpec

SPEC = TrialSpec(model=dataclasses.asdict(load_model("tiny")), layout="dp=4", steps=1, warmup=0)
MARK = "fake-srun-step-8086"


def test_srun_command_line():
    command = srun_command(SPEC, ["node07", "node08"], 4, 29123, "autotune-0123abcd", timeout_s=900)
    assert command == [
        "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=node07,node08",
        "--job-name=autotune-0123abcd", "--kill-on-bad-exit=1", "--time=16",
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d",
        "--rdzv-endpoint=node07:29123", "--rdzv-id=autotune-0123abcd",
        "-m", "autotune.runtime.trial", "--spec", SPEC.to_json()]


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """srun, squeue, scancel and scontrol stand-ins on PATH inside job 4242 of nodes n1-n3;
    returns the file their calls are recorded in, one `name args` line per call."""
    calls = tmp_path / "calls"
    scripts = {
        "scontrol": 'printf "n1\\nn2\\nn3\\n"',
        # the step this trial made, named after its --job-name, and another step of the job
        "squeue": 'printf "4242.6 someone-else\\n4242.7 %s\\n" "$(cat "$(dirname "$0")/step-name")"',
        "scancel": "true",
        "srun": (f'for a in "$@"; do case "$a" in --job-name=*) echo "${{a#--job-name=}}" > '
                 f'"$(dirname "$0")/step-name";; esac; done\n'
                 f"exec {sys.executable} -c 'import time; time.sleep(600)' {MARK}"),
    }
    for name, body in scripts.items():
        path = tmp_path / name
        path.write_text(f'#!/bin/sh\nprintf "%s\\n" "{name} $*" >> "{calls}"\n{body}\n')
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    return calls


def test_slurm_trial_runs_on_the_allocations_first_nodes(fake_slurm):
    (agent,) = trial_agents(SPEC, 4, Launcher("slurm", gpus_per_node=2), 60, "autotune-feed", {})
    assert agent.argv[:7] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=n1,n2",
                              "--job-name=autotune-feed", "--kill-on-bad-exit=1"]
    assert any(a.startswith("--rdzv-endpoint=n1:") for a in agent.argv)
    (chosen,) = trial_agents(SPEC, 4, Launcher("slurm", 2, hosts=("n3", "n2")), 60, "x", {})
    assert "--nodelist=n3,n2" in chosen.argv
    single = trial_agents(SPEC, 4, Launcher("slurm", gpus_per_node=8), 60, "x", {})[0].argv
    assert single[1:5] == ["--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--nodelist=n1"]
    assert "--nproc-per-node=4" in single


def test_slurm_timeout_cancels_the_step(fake_slurm, tmp_path):
    record = run_trial(SPEC, 4, timeout_s=3, log_dir=tmp_path / "trial", launcher=Launcher("slurm", gpus_per_node=2))
    assert (record["status"], record["reason"]) == ("failed", "timeout")
    calls = fake_slurm.read_text().splitlines()
    (srun,) = [c for c in calls if c.startswith("srun ")]
    step_name = srun.split("--job-name=")[1].split()[0]
    assert step_name.startswith("autotune-") and f"--rdzv-id={step_name}" in srun
    assert "scontrol show hostnames" in calls
    assert "squeue --steps --noheader --format=%i %j --jobs=4242" in calls
    assert [c for c in calls if c.startswith("scancel")] == ["scancel 4242.7"]  # this step, not the other
    assert [p for p in psutil.process_iter(["cmdline"]) if MARK in (p.info["cmdline"] or [])] == []


def test_slurm_outside_an_allocation_is_bad_input(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(UsageError, match="--launcher slurm: not inside a SLURM allocation"):
        Launcher("slurm", gpus_per_node=2).check(4)
