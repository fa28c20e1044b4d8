"""Foundation runtime: determinism, learning, and plain data parallel against one process."""

from autotune.config import load_model
from autotune.plan.layout import resolve
from support.numerics import assert_same_losses, assert_same_params
from support.spawn_group import run_layouts

TINY = load_model("tiny")


def full(text: str, gpus: int) -> str:
    return str(resolve(text, TINY, gpus))


def test_same_seed_same_losses_and_loss_falls_over_20_steps():
    first, again, other_seed, long = run_layouts(
        1, [full("", 1)] * 2, steps=3, warmup=1) + run_layouts(1, [full("", 1)], steps=3, warmup=1, seed=1) \
        + run_layouts(1, [full("", 1)], steps=20, warmup=0)
    assert first["losses"] == again["losses"]
    assert first["losses"] != other_seed["losses"]
    losses = long["losses"]
    assert len(losses) == 20
    # From ln(256) ~ 5.5 at random init, the cycle is learned within 20 steps.
    assert losses[-1] < 0.6 * losses[0], losses


def test_plain_data_parallel_matches_one_process():
    reference = run_layouts(1, [full("", 1)], steps=3, with_params=True)[0]
    for gpus in (2, 4):
        result = run_layouts(gpus, [full("zero=0", gpus), full("zero=0,mbs=2", gpus)], steps=3, with_params=True)
        for r in result:
            assert_same_losses(reference["losses"], r["losses"], r["layout"])
            assert_same_params(reference["params"], r["params"], r["layout"])
