"""Data parallel (every zero value, HSDP), gradient accumulation and mixed precision
against one process: same losses at every step, same trained parameters, same gradients."""

import pytest
import torch

from autotune.config import as_trained, load_model
from autotune.plan.layout import resolve
from autotune.runtime.parallel.dp import mixed_precision_policy
from support.numerics import assert_same_losses, assert_same_training
from support.spawn_group import run_layouts, run_on_ranks
from support.step_probe import (
    assert_same_gradients,
    first_step_gradients,
    mixed_precision_step,
    reference_gradients,
    zero_one_against_adamw,
)

TINY = load_model("tiny")  # global batch 16


def full(text: str, gpus: int) -> str:
    return str(resolve(text, TINY, gpus))


@pytest.fixture(scope="module")
def reference():
    """One process, one sequence per micro-batch (16 micro-batches a step), and the same
    global batch cut into 2 and into 1 micro-batch."""
    return run_layouts(1, [full("", 1), full("mbs=8", 1), full("mbs=16", 1)], with_params=True)





def test_micro_batch_split_does_not_change_training(reference):
    one, *splits = reference
    assert_same_training(one, splits)
    assert [r["grad_accum"] for r in reference] == [16, 2, 1]


def test_each_zero_at_dp2_and_mbs1_vs_mbs2(reference):
    layouts = [full(text, 2) for text in ("zero=0", "zero=1,mbs=2", "zero=2,mbs=4", "zero=3", "zero=3,mbs=2")]
    results = run_layouts(2, layouts, with_params=True)
    assert_same_training(reference[0], results)
    assert [r["grad_accum"] for r in results] == [8, 4, 2, 8, 4]


def test_hsdp_2x2_for_each_sharded_zero_and_full_shard_at_dp4(reference):
    layouts = [full(f"dp_shard=2,zero={z},mbs=2", 4) for z in (1, 2, 3)] + [full("zero=3,mbs=4", 4)]
    results = run_layouts(4, layouts, with_params=True)
    assert_same_training(reference[0], results)
    assert all(resolve(r["layout"], TINY, 4).dp_replicate == 2 for r in results[:3])


def test_gradients_equal_one_process_whatever_the_split():
    """Adam is blind to a gradient's scale (m / sqrt(v)), so equal parameters do not prove
    that a layout averages its gradients right: compare the gradients themselves."""
    reference = reference_gradients()
    layouts = [full(text, 2) for text in ("zero=0,mbs=4", "zero=2,mbs=2", "zero=3,mbs=8", "tp=2,sp=1,mbs=4")]
    for layout, grads in zip(layouts, run_on_ranks(2, first_step_gradients, layouts)[0]):
        assert_same_gradients(reference, grads, layout)


def test_mixed_precision_policy_follows_the_trained_precision_on_any_device():
    bf16 = TINY.__class__(**{**TINY.__dict__, "dtype": "bf16"})
    policy = mixed_precision_policy(bf16)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    policy = mixed_precision_policy(TINY.__class__(**{**bf16.__dict__, "grad_dtype": "bf16"}))
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    assert mixed_precision_policy(TINY) is None  # an fp32 model stays fp32
    # The precision a trial trains in: --dtype, else the model's on CUDA, fp32 on the CPU.
    assert (as_trained(bf16, "cpu").dtype, as_trained(bf16, "cuda").dtype) == ("fp32", "bf16")
    assert as_trained(TINY, "cpu", "bf16").dtype == "bf16"


def test_bf16_computes_in_bf16_reduces_and_updates_in_fp32(reference):
    """bf16 on the CPU (the GPU's plan): FSDP (zero 3) keeps fp32 sharded parameters and
    computes in bf16 copies; zero 0 and 1 (ddp.py) keep bf16 parameters beside fp32
    masters. Both reduce fp32 gradients, update fp32 state, and train like fp32 up to
    bf16 rounding."""
    layouts = [full("zero=3,mbs=8", 2), full("tp=2,mbs=16", 2), full("zero=1,mbs=8", 2)]
    fp32 = reference[0]["losses"]
    for layout, seen in zip(layouts, run_on_ranks(2, mixed_precision_step, layouts)[0]):
        assert seen["compute"] == ["torch.bfloat16", "torch.bfloat16"], layout  # a Linear's input and weight
        assert seen["grads"] == seen["masters"] == seen["optimizer_state"] == ["torch.float32"], layout
        held = "torch.float32" if "zero=3" in layout else "torch.bfloat16"
        assert seen["params"] == [held], layout
        assert_same_losses(fp32, seen["losses"], layout, rtol=1e-2)
        assert seen["losses"] != pytest.approx(fp32, rel=1e-6), "bf16 rounding should show"


def test_bf16_gradients_reduce_in_bf16_and_step_in_fp32():
    """grad_dtype bf16 (Megatron-LM without grad_reduce_in_fp32): zero 0/1 keep a bf16
    gradient buffer, the optimizer still reads fp32 gradients (a copy of its slice) and
    updates fp32 state; FSDP reduce-scatters bf16 into its fp32 shards. Each layout trains
    as one process with bf16 gradients does, up to the rounding of a bf16 sum."""
    layouts = [full("mbs=8", 1)]
    one = run_on_ranks(1, mixed_precision_step, layouts, 3, "bf16")[0][0]
    layouts = [full(text, 2) for text in ("zero=0,mbs=4", "zero=1,mbs=8", "zero=3,mbs=8")]
    for layout, seen in zip(layouts, run_on_ranks(2, mixed_precision_step, layouts, 3, "bf16")[0]):
        assert seen["grads"] == seen["masters"] == seen["optimizer_state"] == ["torch.float32"], layout
        assert seen["buffers"] == ([] if "zero=3" in layout else ["torch.bfloat16"]), layout
        assert_same_losses(one["losses"], seen["losses"], layout, rtol=2e-3)
    assert one["buffers"] == ["torch.bfloat16"]
    fp32_gradients = run_on_ranks(1, mixed_precision_step, [full("mbs=8", 1)], 3, "fp32")[0][0]
    assert fp32_gradients["buffers"] == ["torch.float32"]
    assert one["losses"] != pytest.approx(fp32_gradients["losses"], rel=1e-7), "bf16 accumulation should show"


def test_zero1_optimizer_equals_adamw_with_uneven_and_empty_slices():
    """3 ranks, parameters laid out in backward order (the last first): a 4x3 matrix, 7, 1
    and 5 elements. Buckets close once they hold 8 elements and are padded to divide by 3:
    [12] -> 4 each, [7, 1] -> 9, 3 each (the 1-element parameter on one rank only), [5] ->
    6, 2 each (the last rank's slice half padding). Every rank ends with AdamW's parameters,
    holding its slices' state only, and no gradient is left on the parameters."""
    shapes = [[5], [1], [7], [4, 3]]
    ranks = run_on_ranks(3, zero_one_against_adamw, shapes, 8)
    assert [r["state_elements"] for r in ranks] == [4 + 3 + 2, 4 + 3 + 2, 4 + 2 + 1]
    for r in ranks:
        assert r["max_difference"] <= 1e-6
        assert r["grads_left"] == 0
