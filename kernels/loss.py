"""Cross-entropy that holds one micro-batch's logits and no fp32 copy of them.

`F.cross_entropy(logits.float(), labels)`, the usual form, keeps three vocabulary-sized
fp32 tensors alive in its backward (the upcast logits, log_softmax's output and its
gradient): 12 bytes per token and vocabulary entry beside the logits themselves. Here:

    forward   lse = logsumexp over the vocabulary, in fp32, in chunks of rows;
              loss = mean over rows of (lse - the label's logit)
    saves     the logits (as the head made them) and lse (fp32, one per row)
    backward  d logits = (softmax - onehot(label)) * grad / rows, chunk by chunk into
              one tensor in the logits' dtype

so the backward holds the logits, their gradient and one fp32 chunk (CHUNK_ELEMENTS).

Under tensor parallel the logits are vocabulary-sharded (a DTensor sharded on its last
dim, the head's column-parallel output): each rank holds vocab/tp columns; the row max
and the sums of exponentials and of the label's logit are all-reduced over the tp group
(two all-reduces of a row vector each forward), and each rank differentiates its own
columns. The loss is the same on every tp rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

CHUNK_ELEMENTS = 1 << 22  # fp32 elements of the logits worked on at once: 16 MiB


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group, vocab_start: int) -> torch.Tensor:
        rows, vocab = logits.shape
        step = _rows_per_chunk(vocab)
        row_max = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, step):
            row_max[start:start + step] = logits[start:start + step].float().amax(dim=-1)
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        sums = torch.zeros(2, rows, dtype=torch.float32, device=logits.device)  # sum of exp, the label's logit
        local_labels = labels - vocab_start
        here = (local_labels >= 0) & (local_labels < vocab)
        for start in range(0, rows, step):
            chunk = logits[start:start + step].float()
            sums[0, start:start + step] = (chunk - row_max[start:start + step, None]).exp().sum(dim=-1)
            picked = chunk.gather(1, local_labels[start:start + step].clamp(0, vocab - 1)[:, None])[:, 0]
            sums[1, start:start + step] = torch.where(here[start:start + step], picked, 0.0)
        if group is not None:
            dist.all_reduce(sums, group=group)
        lse = row_max + sums[0].log()
        ctx.save_for_backward(logits, labels, lse)
        ctx.vocab_start = vocab_start
        return (lse - sums[1]).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        rows, vocab = logits.shape
        step = _rows_per_chunk(vocab)
        local_labels = labels - ctx.vocab_start
        here = (local_labels >= 0) & (local_labels < vocab)
        out = torch.empty_like(logits)
        scale = grad.float() / rows
        for start in range(0, rows, step):
            probs = (logits[start:start + step].float() - lse[start:start + step, None]).exp_()
            mine = here[start:start + step]
            index = local_labels[start:start + step].clamp(0, vocab - 1)[:, None]
            probs.scatter_add_(1, index, -mine.to(probs.dtype)[:, None])
            out[start:start + step] = probs.mul_(scale)
            del probs  # else the name holds this chunk while the next one is made: one chunk more
        return out, None, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of logits [..., vocab] (a DTensor sharded over the
    vocabulary under tensor parallel) against labels [...] (module docstring)."""
    group, vocab_start = None, 0
    if isinstance(logits, DTensor):
        mesh = logits.device_mesh
        group = mesh.get_group()
        logits = logits.to_local()
        vocab_start = mesh.get_local_rank() * logits.shape[-1]
    return _CrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), group, vocab_start)


def reference_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The plain form, for the tests."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())
