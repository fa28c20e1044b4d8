"""Context parallel alone and with tensor parallel (with and without sequence parallel),
data parallel and recompute, against one process: same losses at every step, same
trained parameters, same gradients; and the activation memory per rank it saves."""

import pytest

from autotune.config import load_model
from autotune.plan.layout import resolve
from support.numerics import assert_same_training
from support.ring_probe import cp_activation_bytes, tiny_with
from support.spawn_group import run_layouts, run_on_ranks
from support.step_probe import assert_same_gradients, first_step_gradients, reference_gradients

TINY = load_model("tiny")  # seq_len 64: cp up to 8 with head-tail sharding


def full(text: str, gpus: int) -> str:
    return str(resolve(text, TINY, gpus))


@pytest.fixture(scope="module")
def reference():
    return run_layouts(1, [full("mbs=8", 1)], with_params=True)[0]



def test_cp2_alone_and_with_recompute(reference):
    layouts = [full(text, 2) for text in ("cp=2,mbs=8", "cp=2,mbs=4,recompute=selective",
                                          "cp=2,mbs=16,recompute=full")]
    assert_same_training(reference, run_layouts(2, layouts, with_params=True))


def test_cp4_cp2_x_tp2_cp2_x_dp2_and_cp2_x_pp2(reference):
    """cp=4 leaves 16 tokens per rank (chunks 8 long); cp x tp rings over the ranks
    that hold the same heads; cp x dp averages gradients over all four ranks; under
    pp=2 each stage rings over its own cp group, and the stages pass head-tail shards."""
    layouts = [full(text, 4) for text in (
        "cp=4,mbs=8", "cp=2,tp=2,mbs=8", "cp=2,tp=2,sp=1,recompute=op,mbs=16",
        "cp=2,dp=2,zero=0,mbs=4", "cp=2,dp=2,zero=3,mbs=8",
        "cp=2,pp=2,schedule=1f1b,mbs=4", "cp=2,pp=2,schedule=zbv,vpp=2,mbs=4")]
    assert_same_training(reference, run_layouts(4, layouts, with_params=True))


def test_cp_gradients_equal_one_process():
    """Adam hides a wrong gradient scale (a missing or doubled average over cp):
    compare the gradients themselves."""
    layouts = [full("cp=2,mbs=16", 2), full("cp=2,mbs=4,recompute=full", 2)]
    expected = reference_gradients()
    for layout, grads in zip(layouts, run_on_ranks(2, first_step_gradients, layouts)[0]):
        assert_same_gradients(expected, grads, layout)


def test_activation_memory_per_rank_falls_as_one_over_cp():
    """tiny at seq_len 2048, one sequence per micro-batch, 4 ranks: dp=4 (each rank the
    whole sequence), cp=2 x dp=2, cp=4. Measured (MemTracker, per rank, held at the
    end of the forward): cp=2 0.50 and cp=4 0.25 of cp=1, peak over the micro-batch
    likewise."""
    model = tiny_with(name="tiny-2k", seq_len=2048, global_batch_size=4)
    layouts = ["dp=4,zero=0", "cp=2,dp=2,zero=0", "cp=4"]
    for cp1, cp2, cp4 in run_on_ranks(4, cp_activation_bytes, model, layouts):
        assert (cp1["tokens"], cp2["tokens"], cp4["tokens"]) == (2048, 1024, 512)
        for key in ("held", "peak"):
            assert 0.45 <= cp2[key] / cp1[key] <= 0.55, (key, cp1, cp2)
            assert 0.2 <= cp4[key] / cp1[key] <= 0.3, (key, cp1, cp4)
