"""What a training loss holds beside the logits: ours against torchtitan 0.3.0's, eager and compiled.

    .venv/bin/python benchmarks/loss_memory.py [--tokens 4096] [--vocab 32000] [--no-write]

The exported torchtitan command trains the layout we priced only if its loss holds what
ours holds. torchtitan's `cross_entropy_loss` upcasts the whole logits to fp32 before
`F.cross_entropy`; ours (autotune_kernels.loss) works in fp32 chunks and writes the
gradient in the logits' dtype. Each loss runs forward and backward over [1, tokens,
vocab] logits on the CPU, twice to warm up (and compile), then once under the profiler
with c10's allocator counting every allocation (runtime/memory.cpu_peak_during); the
figure is the allocator's highest level during that pass less its level before, where
the logits already live, in bytes per logit.
"""

from __future__ import annotations

import argparse
import time

import torch
from results_section import machine, today, write_section
from torchtitan.components.loss import cross_entropy_loss

from autotune.runtime.memory import cpu_peak_during
from autotune.runtime.torch_compat import track_cpu_allocations
from autotune_kernels.loss import cross_entropy as ours


def bytes_per_logit(loss, dtype: torch.dtype, tokens: int, vocab: int) -> float:
    """The most the allocator held during one forward and backward above what it held before."""
    logits = torch.randn(1, tokens, vocab, dtype=dtype)
    labels = torch.randint(0, vocab, (1, tokens))
    for _ in range(2):
        x = logits.clone().requires_grad_()
        loss(x, labels).backward()
        del x
    x = logits.clone().requires_grad_()
    return cpu_peak_during(lambda: loss(x, labels).backward()) / (tokens * vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    if not track_cpu_allocations():
        raise SystemExit("this torch build's c10 does not export caffe2_report_cpu_memory_usage")
    start = time.perf_counter()
    titan = cross_entropy_loss
    losses = {"ours (autotune_kernels.loss)": ours, "torchtitan 0.3.0, eager": titan,
              "torchtitan 0.3.0, compiled (--compile.components loss)": torch.compile(titan)}
    rows = []
    for name, loss in losses.items():
        figures = [bytes_per_logit(loss, dtype, args.tokens, args.vocab) for dtype in (torch.bfloat16, torch.float32)]
        rows.append(f"| {name} | {figures[0]:.2f} | {figures[1]:.2f} |")
        print(rows[-1], flush=True)
    text = f"""## What the loss holds beside the logits (`loss_memory.py`)

Forward and backward of each loss over [1, {args.tokens:,}, {args.vocab:,}] logits on the CPU, the allocator's
highest level less its level before (the logits already live), bytes per logit.
{today()}, {machine()}; {time.perf_counter() - start:.0f} s.

| loss | bf16 logits | fp32 logits |
|---|---:|---:|
{chr(10).join(rows)}

The exported torchtitan command compiles the loss (`--compile.enable --compile.components
loss`), so that torchtitan holds what the estimator prices: the gradient beside the logits,
where its eager loss holds six times as much at bf16.
"""
    print(text)
    if not args.no_write:
        write_section("loss_memory", text)


if __name__ == "__main__":
    main()
