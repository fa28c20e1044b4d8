"""The frameworks whose own code checks the exports, each optional: a test that needs one
that is not installed skips, naming the line that installs it (`pip install -e '.[test]'`
brings them all, pinned as CI runs them)."""

from __future__ import annotations

import importlib.util

import pytest

INSTALL = {"torchtitan": "pip install torchtitan==0.3.0", "deepspeed": "pip install 'deepspeed>=0.19.5'"}


def require(framework: str) -> None:
    """Skip the calling test when `framework` cannot be imported."""
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed: {INSTALL[framework]} (or pip install -e '.[test]')")
