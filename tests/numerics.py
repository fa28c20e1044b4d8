"""The correctness oracle: a layout's losses equal one process's, up to float reordering."""

RTOL = 1e-4


def assert_same_losses(reference: list[float], other: list[float], what: str, rtol: float = RTOL) -> None:
    assert len(reference) == len(other), what
    for step, (a, b) in enumerate(zip(reference, other)):
        assert abs(a - b) <= rtol * abs(a), f"{what}: step {step} loss {b} differs from {a} (rtol {rtol})"


def assert_same_params(reference: dict, other: dict, what: str, atol: float = 1e-5) -> None:
    """Trained weights equal one process's: same names, elementwise within atol (fp32)."""
    assert sorted(reference) == sorted(other), f"{what}: parameter names differ"
    for name in reference:
        worst = max((abs(a - b) for a, b in zip(reference[name], other[name])), default=0.0)
        assert len(reference[name]) == len(other[name]) and worst <= atol, \
            f"{what}: {name} differs by {worst} (atol {atol})"
