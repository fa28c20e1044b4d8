"""Finding a test's processes in the process table, and waiting for them to be gone."""

from __future__ import annotations

import time

import psutil


def processes_with(tag: str) -> list[psutil.Process]:
    """Every process whose command line holds `tag` (a unique seed or marker in a spec)."""
    return [p for p in psutil.process_iter(["cmdline"]) if any(tag in part for part in (p.info["cmdline"] or []))]


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running. A killed process lingers as a zombie until its new parent reaps
    it, a moment that a loaded machine lengthens: a zombie counts as dead."""
    out = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def gone(tag: str, within_s: float = 30.0) -> bool:
    """Whether every process tagged `tag` is dead within `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while alive(processes_with(tag)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
