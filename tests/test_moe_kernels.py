"""MoE kernels against plain references (permutation, grouped matmul, router), and the
MoE block against a token-by-token reference: its output, its balance loss and the
gradient that loss sends to the router, recorded once per micro-batch even when the
block is recomputed. One process, no process group."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from autotune.config import MoEConfig, load_model
from autotune.runtime.init import init_weights
from autotune.runtime.moe import MoE, end_step, set_aux_loss_scale
from autotune_kernels.moe import (
    expert_counts,
    grouped_matmul,
    grouped_matmul_loop,
    grouped_mm_applies,
    inverse_permutation,
    permute,
    route,
    unpermute,
)


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def per_expert_reference(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Row by row: each row times the weight of the expert whose block it is in."""
    owners = [e for e, n in enumerate(counts) for _ in range(n)]
    return torch.stack([x[i] @ w[e] for i, e in enumerate(owners)]) if owners else x.new_zeros(0, w.shape[-1])


def test_permutation_is_expert_major_stable_and_undone():
    g = generator()
    tokens, k, experts_n = 37, 3, 6
    x = torch.randn(tokens, 16, generator=g)
    experts = torch.stack([torch.randperm(experts_n, generator=g)[:k] for _ in range(tokens)])
    routed, order = permute(x, experts)
    assert routed.shape == (tokens * k, 16)
    owner = experts.flatten()[order]
    assert torch.equal(owner, owner.sort().values)  # expert-major
    for e in range(experts_n):  # inside a block, tokens in their original order
        rows = (order // k)[owner == e]
        assert torch.equal(rows, rows.sort().values)
    assert torch.equal(routed, x[order // k])
    assert torch.equal(routed[inverse_permutation(order)].view(tokens, k, -1), x[:, None].expand(-1, k, -1))
    assert torch.equal(expert_counts(experts, experts_n), torch.bincount(owner, minlength=experts_n))
    # Round trip with weights: unpermute sums each token's k copies, weighted.
    weights = torch.rand(tokens, k, generator=g)
    assert torch.allclose(unpermute(routed, order, weights), x * weights.sum(-1, keepdim=True), atol=1e-6)


@pytest.mark.parametrize("dtype, width, uses_torch", [
    (torch.float32, 16, True), (torch.bfloat16, 16, True), (torch.float32, 5, False), (torch.float64, 16, False)])
def test_grouped_matmul_equals_the_loop_and_the_per_row_reference(dtype, width, uses_torch):
    """Forward and both gradients; torch's grouped_mm where dtype and 16-byte rows allow."""
    g = generator(1)
    counts = [3, 0, 9, 1]
    x = torch.randn(sum(counts), width, generator=g).to(dtype).requires_grad_()
    w = torch.randn(len(counts), width, 8, generator=g).to(dtype).requires_grad_()
    assert grouped_mm_applies(x, w) == uses_torch
    grad = torch.randn(sum(counts), 8, generator=g).to(dtype)
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    results = []
    for fn in (grouped_matmul, grouped_matmul_loop, per_expert_reference):
        out = fn(x, w, torch.tensor(counts) if fn is not per_expert_reference else counts)
        results.append((out, *torch.autograd.grad(out, (x, w), grad)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, **tolerance)


def test_experts_that_get_zero_tokens():
    """Empty first and last experts, every token in one expert, and no tokens at all:
    the same output, and a zero weight gradient for each expert without tokens."""
    g = generator(2)
    w = torch.randn(4, 16, 8, generator=g, requires_grad=True)
    for counts in ([0, 5, 2, 0], [0, 0, 7, 0], [0, 0, 0, 0]):
        x = torch.randn(sum(counts), 16, generator=g, requires_grad=True)
        for fn in (grouped_matmul, grouped_matmul_loop):
            out = fn(x, w, torch.tensor(counts))
            torch.testing.assert_close(out, per_expert_reference(x, w, counts))
            (grad_w,) = torch.autograd.grad(out, w, torch.ones_like(out), allow_unused=True)
            for e, n in enumerate(counts):
                if n == 0:
                    assert grad_w is None or not grad_w[e].any()
                else:
                    rows = x.detach()[sum(counts[:e]):sum(counts[:e + 1])]
                    torch.testing.assert_close(grad_w[e], rows.sum(0)[:, None].expand(-1, 8))


def test_router_keeps_top_k_with_normalised_weights():
    logits = torch.randn(50, 8, generator=generator(3))
    probabilities, weights, experts = route(logits, 2)
    torch.testing.assert_close(probabilities, logits.softmax(-1))
    assert torch.equal(experts, logits.topk(2).indices)
    torch.testing.assert_close(weights.sum(-1), torch.ones(50))
    _, single, _ = route(logits, 1)  # top-1 keeps the probability itself (Switch)
    torch.testing.assert_close(single[:, 0], probabilities.max(-1).values)


# -- the MoE block ------------------------------------------------------------------------------

TINY_MOE = load_model("tiny-moe")
WITH_SHARED = dataclasses.replace(TINY_MOE, moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_hidden_size=64,
                                                          num_shared_experts=1, aux_loss_weight=0.3))


def moe_block(cfg) -> MoE:
    block = MoE(cfg)
    init_weights(block, 0, cfg.hidden_size, cfg.num_layers)
    return block


def swiglu(x, gate, up, down):
    return (F.silu(x @ gate) * (x @ up)) @ down


def reference_block(block: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, balance loss) token by token, with the loss written from its definition:
    per sequence E * sum_e f_e P_e, f_e the share of the k choices that went to e and
    P_e the mean probability of e, then the mean over sequences."""
    batch, seq, hidden = x.shape
    probabilities = (x @ block.router.weight.T).softmax(-1)
    weights, chosen = probabilities.topk(block.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for b in range(batch):
        for t in range(seq):
            for j in range(block.top_k):
                e = chosen[b, t, j]
                out[b, t] += weights[b, t, j] * swiglu(x[b, t], block.experts.gate[e], block.experts.up[e],
                                                       block.experts.down[e])
    if block.shared is not None:
        out = out + block.shared(x)
    share = F.one_hot(chosen, block.num_experts).float().sum(2).mean(1) / block.top_k  # [batch, experts]
    aux = block.num_experts * (share * probabilities.mean(1)).sum(-1).mean()
    return out, aux


@pytest.mark.parametrize("cfg", [TINY_MOE, WITH_SHARED], ids=["routed", "with-shared-expert"])
def test_moe_block_output_loss_and_router_gradient_match_the_reference(cfg):
    block = moe_block(cfg)
    x = torch.randn(3, 10, cfg.hidden_size, generator=generator(4))
    out = block(x)
    reference, aux = reference_block(block, x)
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=1e-5)
    # Backward of <out, g> through the block also adds weight * aux to what is minimised.
    g = torch.randn(out.shape, generator=generator(5))
    grads = torch.autograd.grad((out * g).sum(), list(block.parameters()))
    expected = torch.autograd.grad((reference * g).sum() + cfg.moe.aux_loss_weight * aux, list(block.parameters()))
    for name, a, b in zip([n for n, _ in block.named_parameters()], grads, expected):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4, msg=name)
    assert end_step(block, x.device).item() == pytest.approx(cfg.moe.aux_loss_weight * aux.item(), rel=1e-5)
    assert aux.item() >= 1.0  # the loss is 1 at perfect balance and larger otherwise


def test_balance_loss_recorded_once_per_micro_batch_under_recompute_and_scaled():
    """Checkpointing runs the forward again in backward (all of it: early stop off); the
    recorded loss term and expert counts still count each micro-batch once, scaled as
    the trainer's loss."""
    block = moe_block(TINY_MOE)
    micro_batches = [torch.randn(2, 8, TINY_MOE.hidden_size, generator=generator(6 + i)) for i in range(3)]
    set_aux_loss_scale(block, 1 / len(micro_batches))
    expected = 0.0
    for x in micro_batches:
        with set_checkpoint_early_stop(False):
            checkpoint(block, x, use_reentrant=False).sum().backward()
        expected += TINY_MOE.moe.aux_loss_weight * reference_block(block, x)[1].item() / len(micro_batches)
    assert end_step(block, torch.device("cpu")).item() == pytest.approx(expected, rel=1e-5)
    assert block.counts_per_step[-1].sum().item() == 3 * 2 * 8 * TINY_MOE.moe.top_k
    assert end_step(block, torch.device("cpu")).item() == 0.0  # nothing recorded since
