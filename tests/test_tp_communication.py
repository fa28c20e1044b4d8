"""Tensor parallel communicates what Megatron-LM's plan does, collective for collective.

A column-parallel half (wq, wk, wv; gate, up) reduces its input gradient once, not once
per linear: per layer two all-reduces each way without sequence parallel; with it two
all-gathers and two reduce-scatters each way, plus the two regathers of the halves'
inputs for the weight gradients (parallel/sp_saved.py). Counted from the profiler over
one step of one micro-batch, on rank 0 of a fake two-rank group played in this process
(torch's testing backend: the collectives run as no-ops, their count is the plan's).
"""

import collections
import functools

import pytest
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.testing._internal.distributed.fake_pg import FakeStore

from autotune.config import load_model
from autotune.plan.layout import resolve
from autotune.runtime.torch_compat import forget_process_groups
from support.step_probe import step_batches, trainer_for

TINY = load_model("tiny")  # 8 layers, global batch 16: mbs 16 at tp=2 is one micro-batch
LAYERS = TINY.num_layers


@functools.cache
def collectives_of_one_step(text: str) -> dict:
    """{collective: count} that the layout's second step issues (the first builds lazily)."""
    layout = str(resolve(text, TINY, 2))
    cfg, resolved, mesh, trainer = trainer_for(layout)
    trainer.step(step_batches(cfg, resolved, mesh, 0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step(step_batches(cfg, resolved, mesh, 1))
    # DTensor's collectives (the plan's) by their functional ops; every all-reduce, DTensor's
    # and the data-parallel buffer's, by the process group's own op.
    names = [event.name for event in prof.events()]
    counts = collections.Counter(name.removeprefix("_c10d_functional::") for name in names if name in FUNCTIONAL)
    counts["all_reduces_in_all"] = names.count("c10d::allreduce_")
    return counts


FUNCTIONAL = {f"_c10d_functional::{kind}" for kind in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")}


@pytest.fixture(scope="module", autouse=True)
def fake_pair():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()
    forget_process_groups()  # no later test in this process meets a mesh of the fake group


def test_each_half_reduces_its_input_gradient_once():
    plain = collectives_of_one_step("tp=2,mbs=16")
    # + 2: the vocabulary-parallel embedding's forward, the head's input gradient
    assert plain["all_reduce"] == 4 * LAYERS + 2
    assert plain["all_gather_into_tensor"] == plain["reduce_scatter_tensor"] == 0
    # Sequence parallel: the embedding and the head gather or scatter instead (+ 2 each).
    sp = collectives_of_one_step("tp=2,sp=1,mbs=16")
    assert (sp["all_gather_into_tensor"], sp["reduce_scatter_tensor"], sp["all_reduce"]) == \
        (6 * LAYERS + 2, 4 * LAYERS + 2, 0)
    # Full recompute reruns each block's forward (its gathers and scatters) and keeps no
    # gathered input to regather.
    full = collectives_of_one_step("tp=2,sp=1,recompute=full,mbs=16")
    assert (full["all_gather_into_tensor"], full["reduce_scatter_tensor"]) == (6 * LAYERS + 2, 5 * LAYERS + 2)


def test_partial_sum_gradients_are_reduced_once_per_step():
    """The norms' weight gradients under SP (partial sums over tp: 2 per layer and the final
    norm) are summed in the gradient buffer and all-reduced once per step, in one
    collective, whatever the number of micro-batches; per micro-batch they would be 17."""
    one, two = collectives_of_one_step("tp=2,sp=1,mbs=16"), collectives_of_one_step("tp=2,sp=1,mbs=8")
    assert two["reduce_scatter_tensor"] == 2 * one["reduce_scatter_tensor"]  # two micro-batches
    # A micro-batch's own all-reduces are the vocabulary-parallel loss's two (its rows' max
    # and sums, kernels/loss.py); one more for the step's partial sums.
    assert two["all_reduces_in_all"] - one["all_reduces_in_all"] == 2
    assert one["all_reduces_in_all"] == 2 + 1
