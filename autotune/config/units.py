"""The units every memory figure is given in."""

from __future__ import annotations

GIB = 2**30  # memory_gb, budgets and every reported GiB figure


def human_bytes(n: float) -> str:
    """1.23 GiB, 45.00 MiB, 12 B: a memory figure as a person reads it."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"

