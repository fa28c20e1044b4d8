"""Trials across nodes with --launcher torchrun: one agent per node, c10d rendezvous.

Two "nodes" on one machine are two torchrun agents on localhost; a remote host runs its
agent over ssh, which these tests replace by a stand-in that records what it was asked
(no second machine here).
"""

import dataclasses
import os
import stat
import sys
import time

import pytest

from autotune.config import load_model
from autotune.errors import UsageError
from autotune.launch.launchers import KILL_WAIT_S, Launcher, run_trial, trial_agents
from autotune.trialspec import TrialSpec
from support.numerics import assert_same_losses
from support.processes import gone
from support.spawn_group import run_layouts

LAYOUT = "tp=2,pp=1,cp=1,ep=1,dp=2,dp_shard=2,zero=3,mbs=4,schedule=1f1b,vpp=1,recompute=none,sp=1"
TWO_LOCAL_NODES = Launcher("torchrun", gpus_per_node=2, hosts=("localhost", "localhost"))


def spec(**fields):
    return TrialSpec(model=dataclasses.asdict(load_model("tiny")), layout=LAYOUT, steps=2, warmup=0, **fields)


def test_two_node_trial_gives_the_losses_of_the_local_trial(tmp_path):
    # Timed only (profile=False): what is compared is the losses, and reading four ranks'
    # profiles back would double the test's time.
    two_nodes = run_trial(spec(profile=False), 4, timeout_s=300, log_dir=tmp_path / "nodes",
                          launcher=TWO_LOCAL_NODES)
    assert two_nodes["status"] == "complete", two_nodes
    assert two_nodes["world_size"] == 4
    for node in ("node0", "node1"):  # two agents, each with its own log
        assert (tmp_path / "nodes" / f"{node}.stderr.log").exists()
    # The same layout on four local ranks (the numerics tests' warm group runs trial.run as
    # a local launch does).
    local = run_layouts(4, [LAYOUT], steps=2, warmup=0)[0]
    assert_same_losses(local["losses"], two_nodes["losses"], "2 nodes x 2 vs 4 local processes")


def test_timeout_kills_every_node(tmp_path, monkeypatch):
    # A rank of the second node hangs: the trial times out and both agents' trees are killed.
    monkeypatch.setenv("AUTOTUNE_FAULT", "hang rank=3 step=0")
    seed = 424242421  # marks this trial's processes in the process table
    start = time.monotonic()
    record = run_trial(spec(seed=seed), 4, timeout_s=15, log_dir=tmp_path, launcher=TWO_LOCAL_NODES)
    assert (record["status"], record["reason"]) == ("failed", "timeout")
    # run_trial returns once the limit passed and every agent's tree is killed (kill_tree
    # waits up to KILL_WAIT_S for each); what follows is reading the logs.
    assert time.monotonic() - start < 15 + 2 * KILL_WAIT_S + 10
    assert gone(f'"seed":{seed}')


MARK = "fake-remote-agent-5150"


def fake_ssh(folder):
    """An `ssh` that records its arguments, one call per line; a remote command that starts
    an agent waits (an agent that never joins), a remote kill returns at once."""
    script = folder / "ssh"
    script.write_text(f"""#!/bin/sh
printf "%s\\n" "$*" >> "$(dirname "$0")/calls"
case "$*" in *pkill*) exit 0;; esac
exec {sys.executable} -c 'import time; time.sleep(600)' {MARK}
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder / "calls"


def test_remote_agents_start_over_ssh_and_are_killed_there(tmp_path, monkeypatch):
    calls = fake_ssh(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("AUTOTUNE_FAULT", "slow rank=1 seconds=0.1")  # forwarded to the remote agents
    launcher = Launcher("torchrun", gpus_per_node=2, hosts=("gpu-a", "gpu-b"))
    agents = trial_agents(spec(), 4, launcher, 60, "autotune-abc", dict(os.environ))
    assert [a.remote_host for a in agents] == ["gpu-a", "gpu-b"]
    for i, agent in enumerate(agents):
        assert agent.argv[:5] == ["ssh", "-o", "BatchMode=yes", "-tt", f"gpu-{'ab'[i]}"]
        remote = agent.argv[5]
        assert remote.startswith(f"cd {os.getcwd()} && exec env ")
        assert "AUTOTUNE_FAULT='slow rank=1 seconds=0.1'" in remote and "OMP_NUM_THREADS=" in remote
        assert f"{sys.executable} -m torch.distributed.run --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d" \
               f" --rdzv-endpoint=gpu-a:" in remote
        assert f"--rdzv-id=autotune-abc --rdzv-conf=is_host={int(i == 0)} -m autotune.runtime.trial --spec" in remote

    record = run_trial(spec(), 4, timeout_s=3, log_dir=tmp_path / "trial", launcher=launcher)
    assert (record["status"], record["reason"]) == ("failed", "timeout")
    lines = calls.read_text().splitlines()
    starts = [line for line in lines if "torch.distributed.run" in line]
    kills = [line for line in lines if "pkill" in line]
    assert len(starts) == 2 and len(kills) == 2
    rdzv_id = starts[0].split("--rdzv-id=")[1].split()[0]
    assert kills == [f"-o BatchMode=yes {host} pkill -KILL -f -- '[-]-rdzv-id={rdzv_id}'"
                     for host in ("gpu-a", "gpu-b")]
    assert gone(MARK)  # the local ssh clients are gone too


def test_too_few_hosts_is_bad_input():
    with pytest.raises(UsageError, match="--hosts: a trial of 2 nodes .* needs 2 hosts; --hosts names 1"):
        Launcher("torchrun", gpus_per_node=2, hosts=("localhost",)).check(4)
    with pytest.raises(UsageError, match="--gpus-per-node: 6 GPUs do not fill whole nodes of 4"):
        Launcher("torchrun", gpus_per_node=4).check(6)
