"""FSDP's all-gather on gloo, returning once gloo has let go of the buffer it was given.

gloo's work object keeps the all-gather's output alive until its worker thread drops the
work, a moment after the collective has completed. FSDP frees that output once it has
copied the parameters out of it; when the worker is descheduled past that point the block
is freed late, on the worker thread, after the next block's output exists, and a step's
peak memory rises by one block. An MLA+MoE model at dp=2 zero=3 (ua in
benchmarks/estimator_accuracy.py) measured 8,784,856 or 8,952,192 bytes, in two trials of
five on a loaded machine even with the least of three steps (runtime/memory.py). Here
the call waits, after the collective, until the buffer's storage has no more references
than it had before the collective, so each block is freed where the program frees it,
which is what a peak means (docs/metrics.md). FSDP issues its all-gathers synchronously
when there is no all-gather stream, as on the CPU, so the wait hides no overlap; on CUDA
FSDP keeps torch's own all-gather.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from autotune.runtime.torch_compat import FsdpAllGather, storage_references

RELEASE_TIMEOUT_S = 1.0  # a worker thread that holds the buffer longer is left to free it late


class ReleasedAllGather(FsdpAllGather):
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        before = storage_references(output_tensor)
        work = dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=True)
        work.wait()
        del work
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        while storage_references(output_tensor) > before and time.monotonic() < deadline:
            time.sleep(0)  # gloo's worker thread is about to drop the work


def release_in_program_order(module: FSDPModule) -> None:
    """Give a fully_shard unit on the CPU the all-gather above (where this torch takes one)."""
    if FsdpAllGather is not object:
        module.set_custom_all_gather(ReleasedAllGather())
