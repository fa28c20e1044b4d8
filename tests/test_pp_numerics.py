"""Pipeline parallel against one process: every schedule, with data parallel at every
zero value and HSDP, tensor parallel with sequence parallel, recompute and gradient
clipping. Same losses at every step (rtol 1e-4) and same trained parameters, gathered
from every stage and shard."""

import math

import pytest

from autotune.config import load_model
from autotune.plan.layout import resolve
from support.numerics import assert_same_training
from support.spawn_group import run_layouts, run_on_ranks
from support.step_probe import MODEL, assert_same_gradients, first_step_gradients, reference_gradients

TINY = load_model("tiny")  # 8 layers, global batch 16
MAX_GRAD_NORM = 0.2  # the gradients' norm is about 4 in the first steps, so clipping acts


def full(text: str, gpus: int) -> str:
    return str(resolve(text, TINY, gpus))


@pytest.fixture(scope="module")
def references():
    """One process, without and with gradient clipping."""
    return run_layouts(1, [full("mbs=4", 1), (full("mbs=4", 1), {"max_grad_norm": MAX_GRAD_NORM})],
                       with_params=True)


@pytest.fixture(scope="module")
def reference(references):
    return references[0]



CLIPPED = [full("pp=2,schedule=1f1b,mbs=4", 2), full("pp=2,schedule=zbv,vpp=2,mbs=4", 2)]


def test_every_schedule_at_pp2_recompute_and_clipping(references):
    """grad_accum 4 or 8 micro-batches; dualpipev needs 2*pp = 4. Clipping reduces the
    norm across the two stages: losses and parameters match a clipped run of one process,
    which differ from an unclipped one."""
    reference, clipped_reference = references
    layouts = [full(text, 2) for text in (
        "pp=2,schedule=gpipe,mbs=2", "pp=2,schedule=1f1b,mbs=2", "pp=2,schedule=interleaved_1f1b,vpp=2,mbs=4",
        "pp=2,schedule=zero_bubble,vpp=2,mbs=2", "pp=2,schedule=zbv,vpp=2,mbs=4",
        "pp=2,schedule=dualpipev,vpp=2,mbs=4", "pp=2,schedule=1f1b,recompute=full,mbs=4",
        "pp=2,schedule=zbv,vpp=2,recompute=full,mbs=4")]
    results = run_layouts(2, layouts + [(layout, {"max_grad_norm": MAX_GRAD_NORM}) for layout in CLIPPED],
                          with_params=True)
    assert_same_training(reference, results[:len(layouts)])
    assert clipped_reference["losses"][2] != pytest.approx(reference["losses"][2], rel=1e-4)
    assert_same_training(clipped_reference, results[len(layouts):])


def test_clipped_gradients_under_pp2_are_one_process_scaled_by_the_global_norm():
    """The gradients the optimizer sees at step 0 are one process's times max_norm / the
    global norm: the norm is reduced across the two stages (each stage clipping by its
    own norm would scale its gradients by a different factor)."""
    grads = reference_gradients()
    norm = math.sqrt(sum(g * g for grad in grads.values() for g in grad))
    assert norm > 2 * MAX_GRAD_NORM
    clipped = {name: [g * MAX_GRAD_NORM / norm for g in grad] for name, grad in grads.items()}
    for layout, got in zip(CLIPPED, run_on_ranks(2, first_step_gradients, CLIPPED, MODEL,
                                                 {"max_grad_norm": MAX_GRAD_NORM})[0]):
        assert_same_gradients(clipped, got, layout)


def test_pp4_and_pp2_with_every_zero_and_tp_and_clipping_of_sharded_gradients(references):
    """Also clipping where gradients are DTensors (FSDP, TP), pipelined or not."""
    reference, clipped_reference = references
    layouts = [full(text, 4) for text in (
        "pp=4,schedule=1f1b,mbs=2", "pp=4,schedule=interleaved_1f1b,vpp=2,mbs=2",
        "pp=2,dp=2,zero=0,mbs=2", "pp=2,dp=2,zero=1,schedule=interleaved_1f1b,vpp=2,mbs=2",
        "pp=2,dp=2,zero=2,schedule=gpipe,mbs=2", "pp=2,dp=2,zero=3,schedule=zbv,vpp=2,mbs=2",
        "pp=2,dp=2,dp_shard=1,zero=3,schedule=zero_bubble,vpp=2,mbs=2", "pp=2,tp=2,sp=1,mbs=4",
        # SP regathers each half's input in the input step, for the weight step after it
        "pp=2,tp=2,sp=1,schedule=zbv,vpp=2,mbs=4")]
    clipped = [full(text, 4) for text in ("pp=2,tp=2,sp=1,mbs=4", "dp=2,tp=2,zero=3,mbs=4")]
    results = run_layouts(4, layouts + [(layout, {"max_grad_norm": MAX_GRAD_NORM}) for layout in clipped],
                          with_params=True)
    assert_same_training(reference, results[:len(layouts)])
    assert_same_training(clipped_reference, results[len(layouts):])


def test_pp2_x_dp2_x_tp2_zero3_sp_and_hsdp_on_8_processes(reference):
    layouts = [full("pp=2,dp=2,tp=2,zero=3,sp=1,mbs=4", 8), full("pp=2,dp=4,dp_shard=2,zero=3,mbs=2", 8)]
    assert_same_training(reference, run_layouts(8, layouts, with_params=True))
