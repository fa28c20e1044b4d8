"""The correctness oracle: a layout's losses equal one process's, up to float reordering."""

RTOL = 1e-4


def assert_same_losses(reference: list[float], other: list[float], what: str, rtol: float = RTOL) -> None:
    assert len(reference) == len(other), what
    for step, (a, b) in enumerate(zip(reference, other)):
        assert abs(a - b) <= rtol * abs(a), f"{what}: step {step} loss {b} differs from {a} (rtol {rtol})"
