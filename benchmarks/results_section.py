"""Shared by the benchmark scripts: the machine they ran on, and their section of RESULTS.md.

Each script owns one section of RESULTS.md between two HTML comments,

    <!-- begin NAME -->
    ...
    <!-- end NAME -->

and rewrites it whole on every run, so a section is always what its script last
measured; a section not there yet is appended.
"""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def machine() -> str:
    """'2-core AMD EPYC 7B13, Python 3.11.7, load average 6.2': what the figures depend on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()}-core {cpu}, Python {platform.python_version()}, "
            f"load average {os.getloadavg()[0]:.1f}")


def today() -> str:
    return datetime.date.today().isoformat()


def write_section(name: str, text: str) -> None:
    """Replace the section NAME of RESULTS.md with `text` (appended if absent)."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    block = f"{begin}\n{text.strip()}\n{end}"
    current = RESULTS.read_text()
    if begin in current and end in current:
        head, rest = current.split(begin, 1)
        _, tail = rest.split(end, 1)
        RESULTS.write_text(head + block + tail)
    else:
        RESULTS.write_text(current.rstrip("\n") + "\n\n" + block + "\n")
