"""What one trial runs: the controller writes it, every rank reads it.

Plain data (no torch), passed to the ranks as one JSON argument so that it reaches
every node of a multi-node trial without a shared filesystem.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Lines by which the ranks talk to the launcher: rank 0's result on stdout, any rank's
# failure on stderr.
RESULT_MARKER = "AUTOTUNE_RESULT "
ERROR_MARKER = "AUTOTUNE_ERROR "
# A pooled rank (runtime/pool_rank.py) has finished its trial and waits for the next.
DONE_MARKER = "AUTOTUNE_DONE"


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask Linux to kill this process when its parent dies (PR_SET_PDEATHSIG), so no
    launcher or rank outlives the process that started it.

    The request only covers a parent that dies after it is made: one that died between
    our fork and this call has already handed us to init (or a subreaper), so we check
    that our parent is still `parent_pid` (the pid that started us, when the caller
    knows it) and not init, and kill ourselves if not."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        return
    parent = os.getppid()
    if parent == 1 or (parent_pid is not None and parent != parent_pid):
        os.kill(os.getpid(), signal.SIGKILL)


def dying_with(parent_pid: int) -> Callable[[], None]:
    """A `preexec_fn` for subprocess: the child dies with `parent_pid` (this process)."""
    return lambda: die_with_parent(parent_pid)


@dataclass
class TrialSpec:
    model: dict[str, Any]  # ModelConfig fields
    layout: str  # a full layout string (every key)
    steps: int = 5  # measured optimizer steps
    warmup: int = 2  # steps run before measuring (allocator, caches, first collectives)
    seed: int = 0
    device: str = "cpu"
    lr: float = 1e-3
    max_grad_norm: float | None = None  # clip gradients to this global L2 norm; None: no clipping
    memory_budget_gb: float | None = None
    peak_tflops: float | None = None
    hardware: str | None = None
    trace_dir: str | None = None
    # False: time the steps only, without torch.profiler (no communication or memory
    # figures): for runs that only compare losses, where profiling is pure overhead.
    profile: bool = True
    extra: dict[str, Any] = field(default_factory=dict[str, Any])  # options later dimensions add

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "TrialSpec":
        return cls(**json.loads(text))
