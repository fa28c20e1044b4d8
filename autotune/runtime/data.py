"""Synthetic training data that does not depend on the layout.

Row r of the global batch of step s is drawn from a generator keyed by (seed, s, r),
so every layout sees the same global batch however it splits it over data-parallel
ranks and micro-batches; a rank draws only the rows it owns.

The tokens are learnable, so a falling loss shows that training works: each row walks
a fixed random cycle over the vocabulary (the next token is a function of the current
one, a bigram a model learns in a few steps) from a random start, with 10% of tokens
replaced by noise so the task never becomes trivial.
"""

from __future__ import annotations

import torch

from autotune.runtime.init import name_seed

NOISE = 0.1


def vocab_cycle(seed: int, vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(name_seed(seed, "data.cycle"))
    return torch.randperm(vocab_size, generator=generator)


def batch_rows(seed: int, step: int, rows: range, seq_len: int, vocab_size: int) -> torch.Tensor:
    """Token ids [len(rows), seq_len + 1] of the given rows of step `step`'s global batch."""
    cycle = vocab_cycle(seed, vocab_size)
    out = torch.empty(len(rows), seq_len + 1, dtype=torch.long)
    steps = torch.arange(seq_len + 1)
    for i, row in enumerate(rows):
        generator = torch.Generator().manual_seed(name_seed(seed, f"data.{step}.{row}"))
        start = torch.randint(vocab_size, (1,), generator=generator)
        noise = torch.randint(vocab_size, (seq_len + 1,), generator=generator)
        noisy = torch.rand(seq_len + 1, generator=generator) < NOISE
        out[i] = torch.where(noisy, noise, cycle[(start + steps) % vocab_size])
    return out


def micro_batches(seed: int, step: int, dp_rank: int, mbs: int, grad_accum: int,
                  seq_len: int, vocab_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels) per micro-batch for this data-parallel rank: rows
    [dp_rank * mbs * grad_accum, ...) of the global batch, mbs rows at a time."""
    per_rank = mbs * grad_accum
    first = dp_rank * per_rank
    tokens = batch_rows(seed, step, range(first, first + per_rank), seq_len, vocab_size)
    return [(chunk[:, :-1], chunk[:, 1:]) for chunk in tokens.split(mbs)]
