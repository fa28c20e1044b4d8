"""Our own runtime: the layout string, the `autotune trial` command and torchrun.sh."""

from __future__ import annotations

import shlex

from autotune.export import Target
from autotune.record import Question


def trial_command(q: Question, layout: str, model_path: str) -> str:
    """`autotune trial` measuring the layout as the study did (one node: its launcher is local)."""
    spec = q.trial_spec(layout)
    hardware = f" --hardware {spec.hardware}" if spec.hardware else ""
    budget = f" --memory-budget-gb {spec.memory_budget_gb:g}" if spec.memory_budget_gb else ""
    budget += f" --dtype {q.dtype}" if q.dtype else ""
    budget += f" --grad-dtype {q.grad_dtype}" if q.grad_dtype else ""
    return (f"autotune trial --model {model_path} --gpus {q.gpus} --device {spec.device}{hardware}{budget} "
            f"--steps {spec.steps} --warmup {spec.warmup} --seed {spec.seed} --layout \"{layout}\"")


def runtime(t: Target, question: Question, recommended: bool = True) -> tuple[str, str]:
    """layout.txt and torchrun.sh (`recommended`: the layout a sweep measured best, else
    one `autotune export` was given)."""
    L, q = t.layout, question
    spec = q.trial_spec(str(L))
    trial = trial_command(q, str(L), "model.yaml")
    nodes = t.nodes
    what = "the layout autotune recommends" if recommended else "the layout given to `autotune export`"
    layout_txt = (f"{L}\n# {L.short()}: {what} for {t.model.name} on {t.gpus} GPUs.\n"
                  f"# Measure it again (from this folder"
                  + (", on one node" if nodes == 1 else f"; it spans {nodes} nodes: see torchrun.sh") + "):\n"
                  f"#   {trial}\n")
    launch = [f"torchrun --nproc-per-node={t.gpus // nodes}"]
    if nodes == 1:
        launch[0] += " --standalone"
    else:
        launch += [f"--nnodes={nodes} --rdzv-backend=c10d --rdzv-id=autotune",
                   '--rdzv-endpoint="${MASTER_ADDR:?set MASTER_ADDR to the first node}:${MASTER_PORT:-29500}"']
    launch += ["-m autotune.runtime.trial", f"--spec {shlex.quote(spec.to_json())}"]
    where = "on this node" if nodes == 1 else f"on each of the {nodes} nodes (same MASTER_ADDR everywhere)"
    torchrun = "\n".join([
        "#!/usr/bin/env bash",
        f"# The recommended layout ({L.short()}) on autotune's own runtime: {t.gpus} ranks; run this {where}.",
        f"# Every rank runs autotune.runtime.trial: {spec.warmup} warm-up + {spec.steps} measured steps on",
        "# synthetic tokens; rank 0 prints the measurements as one JSON line (AUTOTUNE_RESULT ...).",
        "# Every setting is exact here: it is the runtime that measured the layout.",
        "set -euo pipefail",
        " \\\n  ".join(launch), ""])
    return layout_txt, torchrun
