"""A synthetic study for the report tests: an Optuna study in a results folder, built as
the controller builds one (the question as a study attribute, one trial per layout
with the sampler's params and every figure as user attributes) but with made-up
figures, so that it needs neither the estimator nor a launch.

Figures follow a crude memory and speed model, enough for the outcomes to be
consistent with them (over the budget -> OOM, exposed communication over the
threshold -> comm_bound); the report's logic is what the tests check, not these.
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import optuna
from optuna.trial import TrialState, create_trial

from autotune.config import ModelConfig, load_hardware, load_model
from autotune.plan.layout import Layout
from autotune.plan.space import load_space, valid_layouts
from autotune.study.samplers import key_distributions

GB = 1024 ** 3
# Every outcome a trial can have (autotune/record.py) that the controller records.
OUTCOMES = ("complete", "pruned/predicted_oom", "pruned/oom", "pruned/comm_bound", "failed/crash",
            "failed/timeout", "failed/error")


def question(model: str, gpus: int, space: str, hardware: str, model_name: str | None = None) -> dict:
    """The same fields as autotune.record.Question, as the study stores them."""
    m = dataclasses.asdict(load_model(model))
    if model_name is not None:
        m["name"] = model_name
    hw = load_hardware(hardware)
    s = load_space(space)
    return {"model": m, "gpus": gpus, "space": dataclasses.asdict(s), "hardware": dataclasses.asdict(hw),
            "objective": "tokens_per_s", "sampler": "model", "max_comm_fraction": 0.30,
            "memory_budget_gb": float(hw.memory_gb), "device": "cuda", "steps": 5, "warmup": 2, "seed": 0,
            "gpus_per_node": hw.gpus_per_host, "launcher": "local", "trials": 24, "time_budget_s": None,
            "peak_tflops": None}


def figures(q: dict, model: ModelConfig, layout: Layout) -> dict:
    """Made-up but self-consistent figures of one layout."""
    P, seq, h = model.num_params(), model.seq_len, model.hidden_size
    L = layout
    grad_accum = L.grad_accum(model)
    shard = max(L.dp_shard * L.cp, 1)
    # bf16 params + grads (4 B) and fp32 master + Adam (12 B) per parameter, sharded as zero says.
    static = P / (L.tp * L.pp) * (16 / shard if L.zero == 3 else 4 + 12 / shard)
    per_layer = L.mbs * seq * h * 34 / (L.tp if L.sp else 1) / L.cp
    per_layer *= {"none": 1.0, "selective": 0.55, "op": 0.5, "full": 0.08}[L.recompute]
    in_flight = min(L.pp, grad_accum) if L.pp > 1 else 1
    peak = static + per_layer * model.num_layers / L.pp * in_flight + 2.0 * GB
    bubble = (L.pp - 1) / (grad_accum + L.pp - 1) / (L.vpp if L.vpp > 1 else 1)
    exposed = 0.04 + 0.05 * math.log2(L.tp) + 0.06 * math.log2(L.cp) + (0.08 if L.zero == 3 else 0.0) \
        + 0.12 / L.mbs * (L.tp > 2)
    comm = min(0.9, exposed * 1.9 + 0.05)
    mfu = 0.55 * (1 - bubble) * (1 - exposed) * {"none": 1.0, "selective": 0.97, "op": 0.95, "full": 0.78}[L.recompute]
    mfu *= 1 - 0.02 * (random.Random(str(L)).random())  # a little noise, fixed per layout
    peak_flops = q["hardware"]["peak_tflops"] * 1e12
    tokens = mfu * L.world_size * peak_flops / model.flops_per_token()
    step = model.global_batch_size * seq / tokens
    return {"peak_mem_bytes": peak * (1.06 if L.recompute == "none" else 1.03),
            "predicted_peak_mem_bytes": peak, "tokens_per_s": tokens, "tokens_per_s_per_gpu": tokens / L.world_size,
            "mfu": mfu, "step_time_s": step, "comm_fraction": comm, "exposed_comm_fraction": exposed,
            "predicted_tokens_per_s": tokens * 1.12, "predicted_step_time_s": step / 1.12, "predicted_mfu": mfu * 1.12,
            "predicted_comm_fraction": comm * 0.9, "grad_accum": grad_accum, "world_size": L.world_size}


def make_study(folder: Path, model: str = "llama3-8b", gpus: int = 16, space: str = "dense",
               hardware: str = "h100-sxm", model_name: str | None = None, n_trials: int = 26,
               seed: int = 1) -> optuna.Study:
    """A study in folder/study.db whose trials cover every outcome in OUTCOMES."""
    q = question(model, gpus, space, hardware, model_name)
    config = load_model(model)
    layouts = valid_layouts(config, gpus, load_space(space), q["gpus_per_node"])
    distributions = key_distributions(layouts)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=f"{q['model']['name']}-{gpus}gpus",
                                storage=f"sqlite:///{folder / 'study.db'}", direction="maximize")
    study.set_user_attr("question", q)
    budget = q["memory_budget_gb"] * GB
    picked = random.Random(seed).sample(layouts, n_trials)
    failures = {3: ("crash", "rank 5 died with signal SIGKILL (exit code -9)"),
                9: ("timeout", "exceeded its wall-clock limit of 600 s; its process tree was killed"),
                14: ("error", "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error "
                              "<script>alert('stderr')</script>")}
    for number, layout in enumerate(picked):
        f = figures(q, config, layout)
        attrs = {"layout": str(layout), "layout_short": layout.short(), "duration_s": 40.0 + 3 * number,
                 **{f"predicted_{k}": f[f"predicted_{k}"] for k in ("peak_mem_bytes", "tokens_per_s",
                                                                    "step_time_s", "mfu", "comm_fraction")}}
        measured = {k: f[k] for k in ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu",
                                      "peak_mem_bytes", "comm_fraction", "exposed_comm_fraction", "grad_accum",
                                      "world_size")}
        state, value = TrialState.PRUNED, None
        if number in failures:
            reason, error = failures[number]
            attrs.update(status="failed", reason=reason, error=error,
                         stderr_tail="Traceback (most recent call last):\n  File \"trial.py\", line 88\n" + error)
            state = TrialState.FAIL
        elif f["predicted_peak_mem_bytes"] > budget:
            attrs.update(status="pruned", reason="predicted_oom", duration_s=0.0,
                         error=f"predicted peak {f['predicted_peak_mem_bytes'] / GB:.2f} GiB over the budget of "
                               f"{budget / GB:.2f} GiB")
        elif f["peak_mem_bytes"] > budget:
            attrs.update(status="pruned", reason="oom", error="CUDA out of memory. Tried to allocate 2.00 GiB",
                         **measured)
        elif f["exposed_comm_fraction"] > q["max_comm_fraction"]:
            attrs.update(status="pruned", reason="comm_bound", **measured,
                         error=f"exposed communication {f['exposed_comm_fraction']:.0%} of the step, over the "
                               f"threshold of 30%")
        else:
            attrs.update(status="complete", reason=None, losses=[10.4, 10.1, 9.9, 9.7, 9.6], **measured)
            state, value = TrialState.COMPLETE, f["tokens_per_s"]
        study.add_trial(create_trial(
            state=state, value=value, params={k: getattr(layout, k) for k in distributions},
            distributions=distributions, user_attrs={k: v for k, v in attrs.items() if v is not None}))
    return study
