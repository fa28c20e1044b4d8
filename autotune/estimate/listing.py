"""Every valid layout of a model on a GPU count, priced and ranked: `autotune estimate`
without `--layout`."""

from __future__ import annotations

import math
from typing import Any

from autotune.config import HardwareConfig, ModelConfig
from autotune.estimate.memory import state_floor
from autotune.estimate.pricing import Estimate, estimate, trained_model
from autotune.plan.layout import Layout, enumerate_layouts, enumerate_layouts_skipping
from autotune.plan.schedules import SCHEDULES


def reasonable_space(model: ModelConfig, gpus: int, gpus_per_node: int) -> list[dict[str, Any]]:
    """Sub-spaces covering every dimension, each with schedules and vpp that agree (so
    few combinations are built only to be rejected): tp, pp, cp and ep powers of two
    within their limits (tp in a node, cp at most 16), dp_shard = dp or one node (HSDP),
    zero 0-3, mbs 1, 2, 4, every recompute mode, sp on and off."""
    def powers(limit: int) -> list[int]:
        return [2**i for i in range(limit.bit_length()) if 2**i <= limit]

    base: dict[str, list[Any]] = {"tp": powers(min(gpus, gpus_per_node)), "pp": powers(min(gpus, model.num_layers)),
            "cp": powers(min(gpus, 16, model.seq_len // 2)),
            "ep": powers(min(gpus, model.moe.num_experts)) if model.moe else [1],
            "dp_shard": ["dp"] + ([gpus_per_node] if gpus_per_node < gpus else []),
            "zero": [0, 1, 2, 3], "mbs": [1, 2, 4], "recompute": ["none", "selective", "op", "full"],
            "recompute_layers": [0, 2, 4], "sp": [0, 1]}
    pipelined = [p for p in base["pp"] if p > 1]
    by_vpp: dict[tuple[int, ...], list[str]] = {}
    for schedule in SCHEDULES.values():
        by_vpp.setdefault(schedule.vpp_choices, []).append(schedule.name)
    return [{**base, "schedule": names, "vpp": list(vpps)} if vpps == (1,) else
            {**base, "pp": pipelined, "schedule": names, "vpp": list(vpps)} for vpps, names in by_vpp.items()]


def every_layout(model: ModelConfig, gpus: int, gpus_per_node: int,
                 spaces: list[dict[str, Any]] | None = None) -> list[Layout]:
    """Every valid layout of the spaces (default: `reasonable_space`), each once."""
    layouts: dict[Layout, None] = {}
    for space in spaces or reasonable_space(model, gpus, gpus_per_node):
        layouts.update(dict.fromkeys(enumerate_layouts(model, gpus, space, gpus_per_node)))
    return list(layouts)


def price_every_layout(model: ModelConfig, gpus: int, hardware: HardwareConfig, memory_budget_bytes: float | None,
                       device: str = "cuda", dtype: str | None = None, grad_dtype: str | None = None
                       ) -> tuple[list[Estimate], int, int]:
    """(the estimates of the valid layouts of `reasonable_space` that may fit, how many valid
    layouts there are, how many of them were not priced because their state alone is over
    the budget: estimate/memory.py's state_floor). On a large model most layouts of a
    cluster are such; the enumeration counts them without building them, one floor per
    combination of the keys the state depends on.
    The count is exact because reasonable_space's sub-spaces share no layout (they differ
    in schedule where pp > 1, and one holds pp = 1). A layout priced over the budget gets
    its memory and no time (NaN): ranked after those that fit, by memory."""
    trained = trained_model(model, device, dtype, grad_dtype)

    def over_budget(layout: Layout) -> bool:
        return memory_budget_bytes is not None and state_floor(trained, layout, device) > memory_budget_bytes

    layouts, skipped = {}, 0
    for space in reasonable_space(model, gpus, hardware.scale_up_gpus):
        kept, over = enumerate_layouts_skipping(model, gpus, space, hardware.scale_up_gpus, over_budget)
        layouts.update(dict.fromkeys(kept))
        skipped += over
    priced = [estimate(model, layout, hardware, memory_budget_bytes, device=device, dtype=dtype,
                       grad_dtype=grad_dtype, time_over_budget=False) for layout in layouts]
    return priced, len(layouts) + skipped, skipped


def rank_estimates(estimates: list[Estimate]) -> list[Estimate]:
    """Layouts that fit first, then the predicted OOMs; each by predicted tokens/s,
    fastest first (by peak memory where time is unknown)."""
    def key(e: Estimate) -> tuple[bool, float, float]:
        return (not e.fits, -(0.0 if math.isnan(e.tokens_per_s) else e.tokens_per_s), e.peak_mem_bytes)
    return sorted(estimates, key=key)

