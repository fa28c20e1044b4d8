"""kernels/norm.py and kernels/loss.py against their plain references, and what each keeps
for backward (the reason they exist)."""

import dataclasses

import pytest
import torch

from autotune.config import load_model
from autotune.estimate.memory import LOSS_CHUNK_ELEMENTS, loss_bytes, precision
from autotune.plan.layout import resolve
from autotune.runtime.memory import cpu_peak_during
from autotune.runtime.torch_compat import track_cpu_allocations
from autotune_kernels import loss as loss_kernel
from autotune_kernels.loss import cross_entropy, reference_cross_entropy
from autotune_kernels.norm import reference_rms_norm, rms_norm


def saved_by(fn, *args):
    """(shape, dtype) of every tensor autograd saves while fn(*args) runs."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return saved


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_matches_the_reference_forward_and_backward(dtype, tol):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=generator).to(dtype).requires_grad_()
    w = (torch.rand(64, generator=generator) + 0.5).to(dtype).requires_grad_()
    dy = torch.randn(3, 5, 64, generator=generator).to(dtype)
    y = rms_norm(x, w, 1e-5)
    (gx, gw) = torch.autograd.grad(y, (x, w), dy)
    yr = reference_rms_norm(x, w, 1e-5)
    (rx, rw) = torch.autograd.grad(yr, (x, w), dy)
    for ours, theirs in ((y, yr), (gx, rx), (gw, rw)):
        torch.testing.assert_close(ours.float(), theirs.float(), atol=tol, rtol=tol)
    assert y.dtype == gx.dtype == dtype


def test_rms_norm_keeps_the_input_and_one_root_per_token():
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(64, dtype=torch.bfloat16, requires_grad=True)
    saved = saved_by(rms_norm, x, w, 1e-5)
    assert sorted(saved, key=str) == sorted([((2, 8, 64), torch.bfloat16), ((64,), torch.bfloat16),
                                             ((2, 8, 1), torch.float32)], key=str)
    # the plain form keeps an fp32 copy of x and more
    assert sum(torch.Size(s).numel() * torch.finfo(d).bits // 8 for s, d in saved_by(reference_rms_norm, x, w, 1e-5)) \
        > 2 * sum(torch.Size(s).numel() * torch.finfo(d).bits // 8 for s, d in saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_matches_the_reference_in_chunks(dtype, monkeypatch):
    monkeypatch.setattr(loss_kernel, "CHUNK_ELEMENTS", 600)  # 2 rows of 300 at a time: 4 chunks of 7 rows
    generator = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(7, 300, generator=generator)).to(dtype).requires_grad_()
    labels = torch.randint(300, (7,), generator=generator)
    ours = cross_entropy(logits, labels)
    (grad,) = torch.autograd.grad(ours, logits)
    theirs = reference_cross_entropy(logits, labels)
    (reference_grad,) = torch.autograd.grad(theirs, logits)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.float(), reference_grad.float(), atol=1e-3 if dtype == torch.bfloat16 else 1e-7,
                               rtol=1e-2)
    assert grad.dtype == dtype


def test_cross_entropy_keeps_the_logits_and_one_fp32_value_per_row():
    logits = torch.randn(4, 16, 300, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(300, (4, 16))
    saved = saved_by(cross_entropy, logits, labels)
    assert ((64, 300), torch.bfloat16) in saved and ((64,), torch.float32) in saved
    assert not any(d == torch.float32 and torch.Size(s).numel() >= 64 * 300 for s, d in saved)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cross_entropy_holds_what_the_estimator_prices(dtype):
    """Over 4 chunks of rows, the allocator's peak during forward and backward, above the
    logits, is estimate_memory.loss_bytes' second figure: the gradient and the fp32
    chunks worked in (a chunk more while the loop kept its last chunk alive into the next)."""
    assert track_cpu_allocations() and loss_kernel.CHUNK_ELEMENTS == LOSS_CHUNK_ELEMENTS
    model = dataclasses.replace(load_model("tiny"), seq_len=512, vocab_size=32_000, dtype=dtype)
    layout = resolve("dp=1,mbs=1", model, 1)
    _, priced = loss_bytes(model, layout, precision(model, "cpu"))
    logits = torch.randn(512, 32_000, dtype=getattr(torch, {"fp32": "float32"}.get(dtype, "bfloat16")))
    labels = torch.randint(32_000, (512,))
    x = logits.clone().requires_grad_()
    cross_entropy(x, labels).backward()  # warm: the first pass allocates what the next ones reuse
    x = logits.clone().requires_grad_()
    measured = cpu_peak_during(lambda: cross_entropy(x, labels).backward())
    assert abs(measured - priced) <= 0.01 * priced, (measured, priced)
