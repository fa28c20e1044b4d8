"""runtime/mlp.py's gated activation against autograd's, and what its backward holds."""

import pytest
import torch
import torch.nn.functional as F

from autotune.runtime.memory import cpu_peak_during
from autotune.runtime.mlp import GatedActivation
from autotune.runtime.torch_compat import track_cpu_allocations

ACTIVATIONS = {"swiglu": F.silu, "geglu": lambda x: F.gelu(x, approximate="tanh")}


@pytest.mark.parametrize("kind", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_activation_gives_autograds_values_bit_for_bit(kind, dtype):
    generator = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(3, 7, 96, generator=generator).to(dtype) for _ in range(3))
    gate_ref, up_ref = gate.clone().requires_grad_(), up.clone().requires_grad_()
    expected = ACTIVATIONS[kind](gate_ref) * up_ref
    expected_grads = torch.autograd.grad(expected, (gate_ref, up_ref), grad)
    gate.requires_grad_(), up.requires_grad_()
    out = GatedActivation.apply(gate, up, kind)
    grads = torch.autograd.grad(out, (gate, up), grad)
    assert torch.equal(out, expected)
    for got, want in zip(grads, expected_grads):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", sorted(ACTIVATIONS))
def test_gated_activation_backward_holds_two_tensors_of_its_width(kind):
    """Beside the incoming gradient and the saved gate and up, the backward allocates the
    two gradients it returns and nothing more (estimate_memory prices two tensors of the
    MLP's width at this moment; autograd's own backward held three)."""
    assert track_cpu_allocations()
    gate, up = (torch.randn(256, 1024, requires_grad=True) for _ in range(2))
    grad = torch.randn(256, 1024)
    width = grad.numel() * grad.element_size()
    GatedActivation.apply(gate, up, kind).backward(grad)  # warm
    out = GatedActivation.apply(gate, up, kind)
    gate.grad = up.grad = None
    measured = cpu_peak_during(lambda: out.backward(grad))
    assert 2 * width <= measured < 2.1 * width, (measured, width)
