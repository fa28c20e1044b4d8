"""MoE and expert parallel against one process on tiny-moe (8 experts, top-2, 8 MoE
layers): the same losses (balance losses included) at every step and the same trained
parameters, for plain data parallel, ZeRO, HSDP, recompute and tensor parallel with
and without expert parallel; expert gradients equal one process's (Adam would hide a
wrong scale); a router biased to one expert reports the imbalance it causes."""

import pytest

from autotune.config import load_model
from autotune.plan.layout import resolve
from support.moe_probe import skew_and_split
from support.numerics import assert_same_training
from support.spawn_group import run_layouts, run_on_ranks
from support.step_probe import assert_same_gradients, first_step_gradients, reference_gradients

MOE = load_model("tiny-moe")  # global batch 16


def full(text: str, gpus: int) -> str:
    return str(resolve(text, MOE, gpus))


@pytest.fixture(scope="module")
def reference():
    """One process with 16 micro-batches of one sequence, and with one of 16."""
    return run_layouts(1, [full("", 1), full("mbs=16", 1)], model="tiny-moe", with_params=True)



def test_balance_loss_is_per_sequence_so_the_micro_batch_split_changes_nothing(reference):
    one, whole = reference
    assert_same_training(one, [whole])
    assert one["ep_token_imbalance"] is None  # no expert parallel


@pytest.fixture(scope="module")
def two_ranks(reference):
    layouts = [full(text, 2) for text in (
        "zero=0,mbs=8", "zero=3,mbs=4", "pp=2,schedule=1f1b,mbs=4",  # MoE without expert parallel
        "ep=2,zero=0,mbs=8", "ep=2,zero=3,mbs=2", "ep=2,zero=3,recompute=full,mbs=8",
        "ep=2,zero=2,recompute=op,mbs=8")]
    return run_layouts(2, layouts, model="tiny-moe", with_params=True)


def test_moe_at_dp2_zero3_and_pp2_without_expert_parallel(reference, two_ranks):
    """Under PP each stage adds its own layers' balance losses to the step's loss; torch's
    metadata inference on the first step records none of its own."""
    assert_same_training(reference[0], two_ranks[:3])


def test_ep2_with_dp2_zero_and_recompute(reference, two_ranks):
    assert_same_training(reference[0], two_ranks[3:])
    for r in two_ranks[3:]:
        imbalance = r["ep_token_imbalance"]
        assert sorted(imbalance, key=int) == [str(i) for i in range(MOE.num_layers)]
        assert all(1.0 <= value < 1.3 for value in imbalance.values()), imbalance  # a fresh router: near even


def test_ep4_with_dp4_ep2_with_dp2_x_tp2_hsdp_zero1_cp2_and_pp2(reference):
    """(Tensor parallel with sequence parallel is in the gradient test below.) ep x cp
    carves the ep group from cp ranks, which dispatch different tokens of the same
    sequences; under pp=2 each stage's experts exchange over that stage's dp ranks and
    each stage's balance losses reach the pipeline's loss."""
    layouts = [full(text, 4) for text in (
        "ep=4,mbs=4", "ep=2,tp=2,mbs=8", "ep=2,dp_shard=2,zero=2,mbs=4", "ep=2,zero=1,mbs=4",
        "ep=2,cp=2,mbs=8", "ep=2,pp=2,zero=0,schedule=1f1b,mbs=4")]
    results = run_layouts(4, layouts, model="tiny-moe", with_params=True)
    assert_same_training(reference[0], results)
    assert resolve(results[2]["layout"], MOE, 4).dp_replicate == 2


def test_expert_gradients_equal_one_process():
    """Each expert's gradient sums the ep ranks' tokens, then FSDP divides by dp x cp:
    dividing by the edp ranks only would double it at ep=2, which Adam's m / sqrt(v)
    hides from the losses. Every way FSDP reduces: replicate over edp (zero 0),
    reduce-scatter over two edp_shard ranks (on gloo: sum, then divide), one-rank shard
    groups with (HSDP) and without replicas, and under tensor parallel."""
    reference = reference_gradients("tiny-moe")
    layouts = [full(text, 4) for text in ("ep=2,zero=0,mbs=4", "ep=2,zero=3,mbs=2", "ep=2,dp_shard=2,zero=2,mbs=2",
                                          "ep=4,zero=3,mbs=4", "ep=2,tp=2,sp=1,zero=2,mbs=8")]
    for layout, grads in zip(layouts, run_on_ranks(4, first_step_gradients, layouts, "tiny-moe")[0]):
        assert_same_gradients(reference, grads, layout)


@pytest.fixture(scope="module")
def probes():
    return run_on_ranks(2, skew_and_split, [full("ep=2,zero=0,mbs=8", 2)], 20.0)


def test_router_biased_to_one_expert_reports_its_imbalance(probes, two_ranks):
    """Expert 0 is every token's first choice, so the rank holding experts 0-3 gets all
    T first choices and about 3/7 of the second: max/mean about 2T*5/7 / T = 1.43."""
    skewed = probes[0]["skewed"][0]["ep_token_imbalance"]
    even = two_ranks[3]["ep_token_imbalance"]
    for layer, value in skewed.items():
        assert 1.3 < value <= 2.0, skewed
        assert value > even[layer]


def test_balance_loss_of_sequences_split_over_ranks_is_the_whole_sequences(probes):
    """What context parallel needs: counts summed over the sequence's ranks, each rank
    adding its tokens' share."""
    for rank in probes:
        assert rank["split"]["loss"] > 1.0
        assert rank["split"]["loss_error"] <= 1e-6 * rank["split"]["loss"]
        assert rank["split"]["gradient_error"] <= 1e-7
