"""Fault injection, for proving the tuner survives what real clusters do to it.

The environment variable AUTOTUNE_FAULT holds one fault as space-separated words:

    crash rank=1 step=2 signal=SEGV       the rank kills itself with a signal
    crash rank=1 step=2 exit=3            the rank exits with a code, no Python error
    hang rank=0 step=1                    the rank stops; the others wait in their next collective
    oom rank=1 step=1                     the rank raises torch.OutOfMemoryError
    slow rank=1 seconds=0.5               the rank sleeps before every step
    ... match=dp=4,                       only in trials whose full layout string contains this

A trial reads it once at start; each rank checks it before each step (warm-up steps
count from 0). Nothing happens when the variable is unset.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch

ENV = "AUTOTUNE_FAULT"
KINDS = ("crash", "hang", "oom", "slow")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int = 0
    step: int = 0
    signal: str | None = None
    exit: int | None = None
    seconds: float = 0.0
    match: str = ""

    @classmethod
    def parse(cls, text: str) -> "Fault":
        kind, *words = text.split()
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown fault {kind!r} (known: {', '.join(KINDS)})")
        fields = {}
        for word in words:
            key, _, value = word.partition("=")
            if key in ("rank", "step", "exit"):
                fields[key] = int(value)
            elif key == "seconds":
                fields[key] = float(value)
            elif key in ("signal", "match"):
                fields[key] = value
            else:
                raise ValueError(f"{ENV}: unknown field {key!r}")
        return cls(kind=kind, **fields)

    def applies_to(self, layout: str) -> bool:
        return self.match in layout

    def before_step(self, step: int, rank: int) -> None:
        if rank != self.rank:
            return
        if self.kind == "slow":
            time.sleep(self.seconds)
            return
        if step != self.step:
            return
        if self.kind == "crash":
            if self.exit is not None:
                os._exit(self.exit)
            os.kill(os.getpid(), getattr(signal, f"SIG{self.signal or 'KILL'}"))
        elif self.kind == "oom":
            raise torch.OutOfMemoryError(f"injected out-of-memory error on rank {rank} at step {step}")
        elif self.kind == "hang":
            while True:
                time.sleep(3600)


def fault_for(layout: str) -> Fault | None:
    """The fault the environment asks for, if it applies to this trial's layout."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    fault = Fault.parse(text)
    return fault if fault.applies_to(layout) else None
