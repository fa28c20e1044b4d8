"""Tensor parallel communicates what Megatron-LM's plan does, collective for collective.

A column-parallel half (wq, wk, wv; gate, up) reduces its input gradient once, not once
per linear: per layer two all-reduces each way without sequence parallel; with it two
all-gathers and two reduce-scatters each way, plus the two regathers of the halves'
inputs for the weight gradients (parallel/sp_saved.py). Counted from the profiler over
one step of one micro-batch, on rank 0 of a fake two-rank group played in this process
(torch's testing backend: the collectives run as no-ops, their count is the plan's).
"""

import collections

import pytest
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.testing._internal.distributed.fake_pg import FakeStore

from autotune.config import load_model
from autotune.layout import resolve
from support.step_probe import step_batches, trainer_for

TINY = load_model("tiny")  # 8 layers, global batch 16: mbs 16 at tp=2 is one micro-batch
LAYERS = TINY.num_layers


def collectives_of_one_step(text: str) -> dict:
    """{collective: count} that the layout's second step issues (the first builds lazily)."""
    layout = str(resolve(text, TINY, 2))
    cfg, resolved, mesh, trainer = trainer_for(layout)
    assert resolved.grad_accum(cfg) == 1
    trainer.step(step_batches(cfg, resolved, mesh, 0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step(step_batches(cfg, resolved, mesh, 1))
    kinds = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
    return collections.Counter(event.name.removeprefix("_c10d_functional::") for event in prof.events()
                               if event.name.removeprefix("_c10d_functional::") in kinds)


@pytest.fixture
def fake_pair():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def test_each_half_reduces_its_input_gradient_once(fake_pair):
    # + 2: the vocabulary-parallel embedding's forward, the head's input gradient
    assert collectives_of_one_step("tp=2,mbs=16") == {"all_reduce": 4 * LAYERS + 2}
    # Sequence parallel: the embedding and the head gather or scatter instead (+ 2 each);
    # the all-reduces are the norms' weight gradients (2 per layer and the final norm),
    # partial sums over tp.
    assert collectives_of_one_step("tp=2,sp=1,mbs=16") == {
        "all_gather_into_tensor": 6 * LAYERS + 2, "reduce_scatter_tensor": 4 * LAYERS + 2,
        "all_reduce": 2 * LAYERS + 1}
    # Full recompute reruns each block's forward (its gathers and scatters) and keeps no
    # gathered input to regather.
    assert collectives_of_one_step("tp=2,sp=1,recompute=full,mbs=16") == {
        "all_gather_into_tensor": 6 * LAYERS + 2, "reduce_scatter_tensor": 5 * LAYERS + 2,
        "all_reduce": 2 * LAYERS + 1}
