"""torchtitan 0.3.0's own ConfigManager parses every torchtitan.sh of the layouts in
support/export_layouts.py (in one child process: torchtitan imports for seconds), and
bash reads megatron_args.sh and torchtitan.sh as the arguments the exports hold.
Every test here starts a process: the distributed tier (tests/conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from autotune.export.megatron import megatron
from autotune.export.torchtitan import torchtitan
from support.export_layouts import targets
from support.frameworks import require

SUPPORT = Path(__file__).parent / "support"


def test_torchtitan_accepts_every_export():
    require("torchtitan")
    cases, expected = [], []
    for _, t in targets():
        x = torchtitan(t)
        L = t.layout
        cases.append({"args": x.args, "world": t.gpus, "stages_per_rank": L.vpp})
        expected.append((L, t))
    out = subprocess.run([sys.executable, str(SUPPORT / "torchtitan_check.py")], input=json.dumps(cases),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases) >= 12
    for (L, t), got in zip(expected, results):
        replicate, shard = (L.dp, 1) if L.zero == 0 else (L.dp_replicate, L.dp_shard)
        assert got["dims"] == [replicate, shard, L.cp, L.tp, L.pp, L.ep], L
        assert got["accumulation"] * got["microbatches"] == t.grad_accum
        assert got["compile"] == [True, ["loss"]]  # the loss holds what ours holds; the blocks run eager
        assert got["async_tp"] is False  # as ours: TP's collectives not overlapped with its matmuls
        assert got["ac"].split(".")[0] == {"none": "NoneType", "full": "FullAC"}.get(L.recompute, "SelectiveAC")
        if L.pp > 1:
            assert [sum(n.startswith("layers.") for n in part) for part in got["parts"]] == [
                len(span) for span in t.stage_layers]


def bash_array(script: str, name: str) -> tuple[list[str], str]:
    """The array as bash sees it when the file is sourced, and CUDA_DEVICE_MAX_CONNECTIONS."""
    program = (f"exec() {{ :; }}; source /dev/stdin; printf '%s\\n' \"${{{name}[@]}}\"; "
               "echo \"env=${CUDA_DEVICE_MAX_CONNECTIONS-unset}\"")
    env = {"PATH": "/usr/bin:/bin", "CUDA_DEVICE_MAX_CONNECTIONS": "8", "MASTER_ADDR": "node0"}
    out = subprocess.run(["bash", "-c", program], input=script, capture_output=True, text=True, check=True,
                         env=env).stdout.splitlines()
    return out[:-1], out[-1]


def test_bash_reads_the_scripts_as_the_exports_hold_them():
    for _, t in targets():
        x = megatron(t)
        args, env = bash_array(x.content, "MEGATRON_PARALLEL_ARGS")
        assert args == x.args
        assert env == ("env=1" if "export CUDA_DEVICE_MAX_CONNECTIONS=1" in x.content else
                       "env=unset" if "unset CUDA" in x.content else "env=8")
        x = torchtitan(t)
        args, _ = bash_array(x.content, "TORCHTITAN_ARGS")
        assert args == x.args[:-1] and x.content.rstrip().endswith(x.args[-1])
