"""Run one trial as a child process group and say how it ended.

The controller never joins a process group itself: each trial is `torchrun` (one
agent, N ranks) started in a session of its own, given a wall-clock limit, and on
timeout killed with its whole process tree (torchrun starts each rank in a new
session, so killing torchrun's process group would miss them: the tree is walked
with psutil instead, and each rank also asks Linux to kill it if its parent dies).

A trial wider than one node (`--gpus-per-node G`: nodes = gpus / G) runs one torchrun
agent per node, joined by c10d rendezvous under an id unique to the trial:

    torchrun  the agents of `--hosts`: a local name (localhost, this machine's name)
              runs its agent here, any other over `ssh -tt` (the remote agent gets a
              hangup when its ssh dies); on timeout every agent's tree is killed here
              and each remote host is asked to kill the agent of this rendezvous id
    slurm     one `srun` step in the current allocation, one task (agent) per node, on
              the allocation's first nodes (or `--hosts`); on timeout the step is
              cancelled (`scancel JOB.STEP`, found by its name) and srun killed, and the
              step carries its own `--time` limit as a backstop

Outcome, in the vocabulary of autotune/record.py:

    rank 0 printed a result                       -> the result (complete, or pruned/oom over budget)
    any rank raised an out-of-memory error        -> pruned / oom        (never a crash)
    the wall-clock limit passed                   -> failed / timeout
    a rank died without a Python error            -> failed / crash      (signal or exit code)
    a rank raised a Python exception              -> failed / error      (its last lines kept)
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from autotune.errors import UsageError
from autotune.record import CRASH, ERROR, FAILED, OOM, PRUNED, TIMEOUT
from autotune.trialspec import ERROR_MARKER, RESULT_MARKER, TrialSpec, dying_with

TAIL_LINES = 30
KILL_WAIT_S = 10.0  # how long kill_tree waits for the killed processes to be gone
LAUNCHERS = ("local", "torchrun", "slurm")
# When one node's agent has failed, the others get this long to notice before they are killed
# (they would otherwise wait out the rendezvous or a collective's own timeout).
PEER_GRACE_S = 30.0
LOOPBACK = ("localhost", "127.0.0.1", "::1")
# Environment a remote agent needs from ours: one thread per rank, unbuffered output, fault injection.
FORWARDED_ENV = ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONWARNINGS")
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


def run_trial(spec: TrialSpec, nprocs: int, timeout_s: float, log_dir: Path | None = None,
              launcher: "Launcher | None" = None) -> dict:
    """Launch the trial, wait at most timeout_s, and return its result or failure record.

    stdout and stderr go to files (in log_dir when given) so a chatty trial cannot
    fill a pipe and stall; the caller gets `stderr_tail` either way.
    """
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="autotune-trial-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if launcher is not None and launcher.kind != "local":
        return run_agents(spec, nprocs, timeout_s, log_dir, launcher)
    out_path, err_path = log_dir / "stdout.log", log_dir / "stderr.log"
    start = time.monotonic()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(torchrun_command(spec, nprocs), stdout=out, stderr=err, env=trial_env(spec),
                                start_new_session=True, preexec_fn=dying_with(os.getpid()))
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


def classify(stdout: str, stderr: str, returncode: int, timed_out: bool, timeout_s: float,
             failed_ranks: list[tuple[int, int]] | None = None) -> dict:
    """Turn what the trial printed and how it exited into one outcome record.

    failed_ranks: (rank, exit code) of the ranks that exited abnormally, where the
    launcher knows them (the warm pool); else read from torchrun's failure report."""
    tail = _tail(stderr)
    errors = [json.loads(line[len(ERROR_MARKER):]) for line in stderr.splitlines()
              if line.startswith(ERROR_MARKER)]
    results = [line[len(RESULT_MARKER):] for line in stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if results and not timed_out:
        result = json.loads(results[-1])
        if returncode != 0:  # every rank's figures were gathered; a rank failed while shutting down
            result["warning"] = f"a rank exited abnormally after the result (exit code {returncode})"
        return result
    oom = [e for e in errors if e.get("oom")]
    if oom:
        first = min(oom, key=lambda e: e["time"])
        return _failure(PRUNED, OOM, f"rank {first['rank']}: {first['type']}: {first['message']}", tail)
    if timed_out:
        return _failure(FAILED, TIMEOUT, f"no result after {timeout_s:.0f} s; every process was killed", tail)
    reported = {e["rank"] for e in errors}
    for rank, code in (failed_ranks if failed_ranks is not None else _failed_ranks(stderr)):
        if rank not in reported:  # died without a Python error: a signal or an explicit exit
            how = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
                else f"exit code {code}"
            return _failure(FAILED, CRASH, f"rank {rank} died ({how})", tail)
    if errors:
        first = min(errors, key=lambda e: e["time"])
        return _failure(FAILED, ERROR, f"rank {first['rank']}: {first['type']}: {first['message']}", tail)
    return _failure(FAILED, CRASH, f"the trial exited with code {returncode} and no result", tail)


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
    psutil.wait_procs(procs, timeout=KILL_WAIT_S)


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


# -- trials across nodes: torchrun agents joined by c10d rendezvous, or one srun step ----------

@dataclass(frozen=True)
class Launcher:
    """How a trial's processes start: `kind` local, torchrun or slurm (module docstring);
    `hosts` names the nodes of a torchrun trial (and overrides the allocation's for slurm)."""

    kind: str = "local"
    gpus_per_node: int | None = None
    hosts: tuple[str, ...] = ()

    def layout_of(self, nprocs: int) -> tuple[int, int]:
        """(nodes, processes per node) of a trial of nprocs: nodes = nprocs / gpus_per_node."""
        per_node = self.gpus_per_node or nprocs
        if nprocs <= per_node:
            return 1, nprocs
        if nprocs % per_node:
            raise UsageError(f"--gpus-per-node: {nprocs} GPUs do not fill whole nodes of {per_node}")
        return nprocs // per_node, per_node

    def check(self, nprocs: int) -> None:
        """Bad input before any trial starts: too few hosts, or slurm outside an allocation."""
        if self.kind == "slurm" and "SLURM_JOB_ID" not in os.environ:
            raise UsageError("--launcher slurm: not inside a SLURM allocation (SLURM_JOB_ID is unset); "
                             "start the sweep from sbatch or salloc")
        if self.kind != "local":
            self.node_names(self.layout_of(nprocs)[0])

    def node_names(self, nodes: int) -> list[str]:
        """The hosts of a trial of `nodes` nodes: the first of --hosts, else of the allocation
        (slurm), else this machine alone."""
        if self.hosts:
            names, where = list(self.hosts), "--hosts names"
        elif self.kind == "slurm":
            names, where = allocation_nodes(), "the allocation has"
        else:
            names, where = (["localhost"] if nodes == 1 else []), "--hosts names"
        if len(names) < nodes:
            raise UsageError(f"--hosts: a trial of {nodes} nodes ({self.gpus_per_node} GPUs each) needs {nodes} "
                             f"hosts; {where} {len(names)} ({','.join(names) or 'none'})")
        return names[:nodes]


@dataclass
class Agent:
    """One process this machine starts for a trial: a torchrun agent (here or over ssh) or srun."""

    argv: list[str]
    name: str  # log file prefix
    remote_host: str | None = None  # ssh: stdout and stderr arrive merged through the tty


def agent_command(spec: TrialSpec, nnodes: int, nproc: int, endpoint: str, rdzv_id: str,
                  is_host: bool | None = None) -> list[str]:
    """torchrun for one node; is_host says which agent serves the rendezvous store (None:
    torchrun decides by matching the endpoint against the machine's names)."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}"]
    if is_host is not None:
        command.append(f"--rdzv-conf=is_host={int(is_host)}")
    return command + ["-m", "autotune.runtime.trial", "--spec", spec.to_json()]


def ssh_command(host: str, command: list[str], env: dict) -> list[str]:
    """Run `command` on host in this directory with our forwarded environment. -tt gives it a
    terminal, so it gets a hangup (torchrun then kills its ranks) when the ssh client dies."""
    forwarded = {k: v for k, v in env.items() if k in FORWARDED_ENV or k.startswith("AUTOTUNE_")}
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(forwarded.items()))
    remote = f"cd {shlex.quote(os.getcwd())} && exec env {assignments} {shlex.join(command)}"
    return ["ssh", "-o", "BatchMode=yes", "-tt", host, remote]


def srun_command(spec: TrialSpec, nodes: list[str], nproc: int, port: int, rdzv_id: str,
                 timeout_s: float) -> list[str]:
    """One step on these nodes of the allocation, one torchrun agent per node; the step is
    named by the rendezvous id (to find it for scancel) and ends by its own --time at the latest."""
    minutes = math.ceil(timeout_s / 60) + 1
    return ["srun", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
            f"--nodelist={','.join(nodes)}", f"--job-name={rdzv_id}", "--kill-on-bad-exit=1", f"--time={minutes}",
            *agent_command(spec, len(nodes), nproc, f"{nodes[0]}:{port}", rdzv_id)]


def trial_agents(spec: TrialSpec, nprocs: int, launcher: Launcher, timeout_s: float, rdzv_id: str,
                 env: dict) -> list[Agent]:
    nodes, per_node = launcher.layout_of(nprocs)
    names = launcher.node_names(nodes)
    if launcher.kind == "slurm":
        return [Agent(srun_command(spec, names, per_node, random.randrange(20000, 30000), rdzv_id, timeout_s),
                      "srun")]
    local = [is_local(host) for host in names]
    if all(local):
        endpoint_host, port = "127.0.0.1", free_port()
    else:  # the remote agents must reach the first host by a name that is not loopback
        endpoint_host = socket.getfqdn() if names[0] in LOOPBACK else names[0]
        port = free_port() if local[0] else random.randrange(20000, 30000)
    agents = []
    for i, (host, here) in enumerate(zip(names, local)):
        command = agent_command(spec, nodes, per_node, f"{endpoint_host}:{port}", rdzv_id, is_host=i == 0)
        agents.append(Agent(command, f"node{i}") if here else
                      Agent(ssh_command(host, command, env), f"node{i}", remote_host=host))
    return agents


def run_agents(spec: TrialSpec, nprocs: int, timeout_s: float, log_dir: Path, launcher: Launcher) -> dict:
    """Start every agent, wait for all (a failed one's peers get PEER_GRACE_S), kill what is
    left on every node, and classify what they printed together."""
    rdzv_id = f"autotune-{uuid.uuid4().hex[:12]}"
    env = trial_env(spec)
    agents = trial_agents(spec, nprocs, launcher, timeout_s, rdzv_id, env)
    start = time.monotonic()
    logs, procs = [], []
    try:
        for agent in agents:
            out, err = (open(log_dir / f"{agent.name}.{stream}.log", "w") for stream in ("stdout", "stderr"))
            logs += [out, err]
            procs.append(subprocess.Popen(agent.argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                          start_new_session=True, preexec_fn=dying_with(os.getpid())))
        timed_out = wait_all(procs, timeout_s)
    finally:  # a timeout, a failed peer's grace, Ctrl-C or our own failure: leave nothing running
        if any(p.poll() is None for p in procs):
            kill_agents(agents, procs, launcher, rdzv_id)
        for f in logs:
            f.close()
    stdout = "".join((log_dir / f"{a.name}.stdout.log").read_text(errors="replace") for a in agents)
    stderr = "".join((log_dir / f"{a.name}.{'stdout' if a.remote_host else 'stderr'}.log").read_text(
        errors="replace") for a in agents)
    codes = [p.returncode for p in procs]
    record = classify(stdout, stderr, next((c for c in codes if c != 0), 0), timed_out, timeout_s)
    record["duration_s"] = time.monotonic() - start
    return record


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> bool:
    """Wait for every process; True if the wall-clock limit passed first. Returns early
    (False) when one failed and the others outlived PEER_GRACE_S."""
    deadline = time.monotonic() + timeout_s
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if now >= deadline:
            return True
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if failed_at is not None and now - failed_at > PEER_GRACE_S:
            return False
        time.sleep(0.2)
    return False


def kill_agents(agents: list[Agent], procs: list[subprocess.Popen], launcher: Launcher, rdzv_id: str) -> None:
    """Kill the trial on every node: the step (slurm) or the remote agents (ssh), then every
    local process tree (which a failing scheduler or ssh command must not prevent)."""
    if launcher.kind == "slurm":
        for step in step_ids(rdzv_id):
            quiet_run(["scancel", step])
    for agent in agents:
        if agent.remote_host:  # [-] keeps the pattern from matching this kill command itself
            quiet_run(["ssh", "-o", "BatchMode=yes", agent.remote_host, f"pkill -KILL -f -- '[-]-rdzv-id={rdzv_id}'"])
    for proc in procs:
        kill_tree(proc.pid)
        proc.wait()


def step_ids(step_name: str) -> list[str]:
    """The steps of this job with this name (squeue lists a step as `JOB.STEP NAME`)."""
    listing = quiet_run(["squeue", "--steps", "--noheader", "--format=%i %j", f"--jobs={os.environ['SLURM_JOB_ID']}"])
    return [line.split()[0] for line in listing.splitlines() if line.split()[1:] == [step_name]]


def allocation_nodes() -> list[str]:
    """The nodes of the current SLURM allocation, in order (the first hosts the rendezvous)."""
    return quiet_run(["scontrol", "show", "hostnames"]).split()


def quiet_run(argv: list[str]) -> str:
    """stdout of a helper command; "" when it is missing, fails or hangs."""
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def is_local(host: str) -> bool:
    return host in LOOPBACK or host in (socket.gethostname(), socket.getfqdn())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
