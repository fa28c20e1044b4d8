"""What a training loss holds at its peak: ours against torchtitan 0.3.0's and Megatron-core's.

    .venv/bin/python benchmarks/loss_memory.py [--tokens 4096] [--vocab 32000] [--no-write]

An exported command trains the layout we priced only if the framework's loss holds what
ours holds. torchtitan's `cross_entropy_loss` upcasts the whole logits to fp32 before
`F.cross_entropy`; Megatron-core's `vocab_parallel_cross_entropy` works on an fp32 copy
of them and keeps their softmax for backward; ours (autotune_kernels.loss) works in fp32
chunks and writes the gradient in the logits' dtype. Under tensor parallel the torchtitan
of December 2024 (its published runs) split the logits over the vocabulary as a DTensor and
ran the same `F.cross_entropy` on their fp32 copy inside torch's `loss_parallel` (its own
log-softmax over the shard, with collectives for the row maxima and sums), measured here on
a one-rank mesh, which holds per logit what each rank of a larger one holds.

Each loss takes the logits from a head, as in a model: hidden [1, tokens, 16] @ [16, vocab],
the hidden state and the head's weight requiring gradients, so that the logits are freed
when the loss does not keep them. Forward and backward run twice to warm up (and
compile), then once under the profiler with c10's allocator counting every allocation
(runtime/memory.cpu_peak_during); the figure is the allocator's highest level during that
pass less its level before, in bytes per logit (the logits themselves included).

Megatron-core is not among our dependencies: its rows appear where it can be imported
(`pip install --no-deps megatron-core`; its cross-entropy needs only torch), with a
one-process gloo group as its tensor-parallel group.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time

import torch
import torch.distributed as dist
from results_section import machine, today, write_section
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torchtitan.components.loss import cross_entropy_loss

from autotune.runtime.memory import cpu_peak_during
from autotune.runtime.torch_compat import track_cpu_allocations
from autotune_kernels.loss import cross_entropy as ours

HIDDEN = 16  # the head's input width: small beside the vocabulary, so the logits dominate


def bytes_per_logit(loss, dtype: torch.dtype, tokens: int, vocab: int, context=contextlib.nullcontext) -> float:
    """The most the allocator held from the head's forward to the end of backward, above what
    it held before; forward and backward inside `context()`."""
    hidden = torch.randn(1, tokens, HIDDEN, dtype=dtype, requires_grad=True)
    head = torch.randn(HIDDEN, vocab, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))

    def step():
        with context():
            loss(hidden @ head, labels).backward()

    for _ in range(2):
        step()
    return cpu_peak_during(step) / (tokens * vocab)


def one_process_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)


def loss_parallel_loss():
    """The fp32 cross-entropy on logits split over the vocabulary (a one-rank TP mesh), to run
    under torch's loss_parallel, as torchtitan's train.py of December 2024 did under TP."""
    one_process_group()
    mesh = init_device_mesh("cpu", (1,))

    def loss(logits, labels):
        split = DTensor.from_local(logits, mesh, [Shard(2)])
        return torch.nn.functional.cross_entropy(split.flatten(0, 1).float(), labels.flatten(0, 1))
    return loss


def torchtitan_2024_03_loss(logits, labels):
    """torchtitan's train.py of March 2024 (its FSDP2 runs, published_runs.csv tt-e): the model's
    head returned `.float()` logits, which train.py kept (`pred`) until the step ended, and
    F.cross_entropy ran on them eager."""
    pred = logits.float()
    loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
    loss.pred = pred  # referenced through backward, as train.py's `pred` was
    return loss


def megatron_losses() -> dict:
    """Megatron-core's two native cross-entropies on a one-process tensor-parallel group, or none."""
    try:
        from megatron.core import parallel_state
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
        from megatron.core.package_info import __version__
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    except ImportError:
        return {}
    one_process_group()
    group = dist.new_group([0])
    parallel_state._TENSOR_MODEL_PARALLEL_GROUP = group  # what initialize_model_parallel(1) would set
    # [batch, seq, vocab] logits, as ours and torchtitan's take them; Megatron's are [seq, batch, vocab]
    return {f"Megatron-core {__version__}, unfused":
            (lambda x, y: vocab_parallel_cross_entropy(x.transpose(0, 1), y.transpose(0, 1)).sum(), None),
            f"Megatron-core {__version__}, --cross-entropy-loss-fusion (native)":
            (lambda x, y: fused_vocab_parallel_cross_entropy(x.transpose(0, 1), y.transpose(0, 1), group).sum(), None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    if not track_cpu_allocations():
        raise SystemExit("this torch build's c10 does not export caffe2_report_cpu_memory_usage")
    start = time.perf_counter()
    losses = {"ours (autotune_kernels.loss)": (ours, None), "torchtitan 0.3.0, eager": (cross_entropy_loss, None),
              "torchtitan 0.3.0, compiled (--compile.components loss)": (torch.compile(cross_entropy_loss), None),
              "torchtitan of 2024-12 under TP, eager (torch's loss_parallel)": (loss_parallel_loss(), loss_parallel),
              "torchtitan of 2024-03, eager (fp32 head output kept through backward)": (torchtitan_2024_03_loss, None),
              **megatron_losses()}
    rows = []
    for name, (loss, context) in losses.items():
        figures = [bytes_per_logit(loss, dtype, args.tokens, args.vocab, context or contextlib.nullcontext)
                   for dtype in (torch.bfloat16, torch.float32)]
        rows.append(f"| {name} | {figures[0]:.2f} | {figures[1]:.2f} |")
        print(rows[-1], flush=True)
    text = f"""## What the loss holds at its peak (`loss_memory.py`)

The head's forward, the loss and their backward over [{args.tokens:,}, {args.vocab:,}] logits on the CPU: the
allocator's highest level less its level before, bytes per logit (the logits included).
{today()}, {machine()}; {time.perf_counter() - start:.0f} s.

| loss | bf16 logits | fp32 logits |
|---|---:|---:|
{chr(10).join(rows)}

The exported torchtitan command compiles the loss (`--compile.enable --compile.components
loss`), so that torchtitan holds what the estimator prices. Megatron-LM's export says what
its loss holds beyond ours at the layout (docs/results.md, "best/"). The eager figures are what
torchtitan's published runs of December 2024 held (their loss ran eager; loss_parallel under
TP), and those of the torchtitan of March 2024 and of Megatron's unfused cross-entropy what
the runs of published_runs.csv with an active or allocated figure held: published_runs.py
adds them to the estimator's peak where it compares with their memory.
"""
    print(text)
    if not args.no_write:
        write_section("loss_memory", text)


if __name__ == "__main__":
    main()
