"""The correctness oracle: a layout's losses equal one process's, up to float reordering."""

import torch

RTOL = 1e-4
# Adam divides each gradient element by its own running magnitude, so an element whose
# gradient nearly cancels moves by a visible fraction of lr (1e-3) when the summation
# order changes (another micro-batch split, a matmul cut by TP): up to 2.4e-5 on one
# element in 8192 has been seen, with a mean difference of ~2e-9. A wrong shard or a
# missing reduction moves every element by ~lr; a wrong gradient scale, which Adam
# hides, is caught by comparing the gradients themselves (step_probe.py).
PARAM_ATOL = 1e-4


def assert_same_losses(reference: list[float], other: list[float], what: str, rtol: float = RTOL) -> None:
    assert len(reference) == len(other), what
    for step, (a, b) in enumerate(zip(reference, other)):
        assert abs(a - b) <= rtol * abs(a), f"{what}: step {step} loss {b} differs from {a} (rtol {rtol})"


def assert_same_params(reference: dict, other: dict, what: str, atol: float = 1e-5) -> None:
    """Trained weights equal one process's: same names, elementwise within atol (fp32)."""
    assert sorted(reference) == sorted(other), f"{what}: parameter names differ"
    for name in reference:
        assert len(reference[name]) == len(other[name]), f"{what}: {name} has another size"
        # float64 holds each fp32 value exactly; a third of a million a layout, compared in C
        a, b = torch.tensor(reference[name], dtype=torch.float64), torch.tensor(other[name], dtype=torch.float64)
        worst = (a - b).abs().max().item() if a.numel() else 0.0
        assert worst <= atol, f"{what}: {name} differs by {worst} (atol {atol})"


def assert_same_training(reference: dict, results: list[dict]) -> None:
    """Each layout's run (spawn_group.run_layouts with params) trained as one process did:
    at least 3 steps, the same losses, the same trained parameters."""
    for r in results:
        assert r["steps"] >= 3
        assert_same_losses(reference["losses"], r["losses"], r["layout"])
        assert_same_params(reference["params"], r["params"], r["layout"], atol=PARAM_ATOL)
