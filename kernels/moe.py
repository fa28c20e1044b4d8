"""Mixture-of-Experts kernels: the router, token permutation and the grouped expert matmul.

A token-choice MoE layer runs in four steps, each a function here with a plain
reference next to it in the tests:

    route         softmax over the experts, keep each token's top-k (and their weights)
    permute       copy every (token, choice) pair into expert-major order, so that each
                  expert's tokens are one contiguous block; `expert_counts` sizes the blocks
    grouped_matmul  each block times its own expert's weight, in one call
    unpermute     bring the expert outputs back to token order and sum each token's k
                  outputs with its routing weights

Nothing is dropped: the blocks are as long as the router makes them (no capacity
factor), so an expert may get zero tokens.

The grouped matmul is torch's `torch.nn.functional.grouped_mm` where it applies:
float32, bfloat16 or float16 operands whose rows are 16-byte aligned, on the CPU or
CUDA. On CUDA it is CUTLASS's grouped GEMM for bf16 on sm90/sm100 (no host sync);
other dtypes and devices run torch's own loop over the groups. Where it does not
apply (float64, odd widths, another device) `grouped_matmul` loops over the experts
itself. torch's backward needs a contiguous incoming gradient, which the layers after
it (SwiGLU's product, the gather of `unpermute`, an all-to-all) always hand it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GROUPED_MM_DEVICES = ("cpu", "cuda")
ALIGNMENT_BYTES = 16


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits [tokens, experts] -> (probabilities, weights, experts).

    probabilities: softmax over all experts in fp32 [tokens, experts] (the balance loss
    needs them); experts: each token's top_k choices [tokens, top_k], best first;
    weights: their probabilities [tokens, top_k], renormalised to sum to one when
    top_k > 1 (Mixtral, Qwen3-MoE), the raw probability when top_k = 1 (Switch), so
    that a single choice still passes gradient to the router.
    """
    probabilities = logits.float().softmax(dim=-1)
    weights, experts = probabilities.topk(top_k, dim=-1)
    if top_k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probabilities, weights, experts


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert: int64 [num_experts] from choices of any shape."""
    return torch.bincount(experts.flatten(), minlength=num_experts)


def permute(tokens: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [T, hidden], experts [T, k] -> (routed [T*k, hidden] in expert-major order, order).

    order[i] is the flat (token * k + choice) index of routed row i; the sort is
    stable, so inside an expert's block tokens keep their order, whatever the layout.
    """
    order = experts.flatten().argsort(stable=True)
    return tokens[order // experts.shape[1]], order


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """The index that undoes `order`: x[order][inverse] == x."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def unpermute(routed: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Expert outputs [T*k, hidden] in expert-major order -> [T, hidden]: each token's k
    outputs weighted by its routing weights [T, k] and summed, in choice order."""
    tokens, k = weights.shape
    by_token = routed[inverse_permutation(order)].view(tokens, k, -1)
    return (by_token * weights.to(routed.dtype).unsqueeze(-1)).sum(dim=1)


def grouped_mm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes these operands: a dtype and device it
    supports, and every row starting on a 16-byte boundary."""
    if x.dtype != w.dtype or x.dtype not in GROUPED_MM_DTYPES or x.device.type not in GROUPED_MM_DEVICES:
        return False
    size = x.element_size()
    return (x.is_contiguous() and w.is_contiguous()
            and (x.shape[-1] * size) % ALIGNMENT_BYTES == 0 and (w.shape[-1] * size) % ALIGNMENT_BYTES == 0
            and x.data_ptr() % ALIGNMENT_BYTES == 0 and w.data_ptr() % ALIGNMENT_BYTES == 0)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [N, in] in expert-major blocks of `counts` rows, w [experts, in, out] -> [N, out]:
    block e times w[e]. Torch's grouped matmul where it applies, else a loop."""
    if grouped_mm_applies(x, w):
        offsets = counts.cumsum(0).to(torch.int32)
        return F.grouped_mm(x, w, offs=offsets)
    return grouped_matmul_loop(x, w, counts)


def grouped_matmul_loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The same product, one matmul per expert (experts with no rows included, so the
    autograd graph and every expert's gradient exist whatever the routing)."""
    blocks = x.split(counts.tolist())
    return torch.cat([block @ w[e] for e, block in enumerate(blocks)])
