"""Which layers each pipeline stage holds, and which stages each pipeline rank runs.

Pure Python, shared by the runtime (runtime/parallel/pp.py builds the stages from it)
and the estimator (which prices what each rank holds), so the two never disagree.

A layout has pp * vpp stages (one per rank without virtual stages). Layers go to
stages in order, whole; the first stage also holds the embedding, the last the final
norm and the output head. Those two are weighed as layers when balancing:

    end weight = the head's FLOPs per token / a mean layer's FLOPs per token
               = 6*vocab*hidden / ((6*block matmul params + 12*heads*head_dim*seq) / layers)

in layers, the same for the embedding and the head. The head's matmul costs exactly
that; the embedding's lookup is nearly free, but its table, gradient and AdamW state
weigh as much as the head's, and the first stage already keeps the most micro-batches
in flight (1F1B: pp of them), so lightening it pays off in memory instead. Stage i
ends after the layer where the running weight (the embedding's, then one per layer)
comes nearest to (i+1)/(pp*vpp) of the total, num_layers + 2 * end weight; every stage
keeps at least one layer. On the tiny preset the weight is 0.36, so its 8 layers split
evenly; on llama3-8b it is 1.84, and pp=4 gives 7, 9, 9, 7 layers.

Stage ids per rank, by the schedule's placement (autotune/plan/schedules.py): looped
schedules put stages rank, rank+pp, rank+2pp, ... on a rank; V schedules put stages
rank and 2*pp-1-rank, so rank 0 holds the first and the last stage.
"""

from __future__ import annotations

import functools
import math

from autotune.config import ModelConfig, per_model_object
from autotune.plan.layout import Layout
from autotune.plan.schedules import SCHEDULES


@per_model_object
def end_weight(model: ModelConfig) -> float:
    """Layers the embedding and the head each weigh when stages are balanced. Kept per
    model object: the FLOPs walk every layer, and the estimator splits stages for each
    layout it prices."""
    head = 6 * model.embedding_params()
    mean_layer = (model.flops_per_token() - head) / model.num_layers
    return head / mean_layer


def stage_count(layout: Layout) -> int:
    return layout.pp * layout.vpp


def stage_layers(model: ModelConfig, stages: int) -> tuple[range, ...]:
    """The global layer indices of each of `stages` stages (each at least one layer)."""
    counts = _split(model.num_layers, stages, end_weight(model))
    starts = [sum(counts[:i]) for i in range(stages)]
    return tuple(range(start, start + count) for start, count in zip(starts, counts))


@functools.lru_cache(maxsize=4096)
def _split(num_layers: int, stages: int, weight: float) -> tuple[int, ...]:
    """Layers per stage, the first and the last stage carrying `weight` more each."""
    if num_layers < stages:
        raise ValueError(f"{num_layers} layers cannot fill {stages} stages")
    share = (num_layers + 2 * weight) / stages
    ends, previous = [], 0
    for i in range(stages - 1):
        end = math.floor((i + 1) * share - weight + 0.5)
        previous = min(max(end, previous + 1), num_layers - (stages - 1 - i))
        ends.append(previous)
    bounds = [0, *ends, num_layers]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def rank_stage_ids(layout: Layout, rank: int) -> tuple[int, ...]:
    """The stages pipeline rank `rank` runs, in increasing order."""
    if layout.pp == 1:
        return (0,)
    if SCHEDULES[layout.schedule].v_shape:
        return (rank, 2 * layout.pp - 1 - rank)
    return tuple(rank + k * layout.pp for k in range(layout.vpp))
