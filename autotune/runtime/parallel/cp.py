"""Context parallel: the sequence is split over the cp ranks and attention runs as a ring.

Every rank of a cp group holds seq_len/cp tokens of each sequence, head-tail sharded:
the sequence is cut into 2*cp chunks and cp rank r holds chunks r and 2*cp-1-r, so
under the causal mask every rank does the same attention work (a contiguous split
would leave the first rank almost idle and the last with most of the work). Only
attention mixes tokens; everything else in the model is per token and runs on the
local tokens unchanged. So context parallel is three small things:

- each block's attention core becomes ring attention over the cp group
  (autotune_kernels.attention.ring_attention: KV blocks pass around the ring, merged by
  their log-sum-exp; dK/dV pass back around in backward);
- each block's RoPE positions are this rank's head-tail positions (`Attention.positions`);
- the trainer shards each micro-batch's tokens and labels the same way before the
  forward (`shard_batch`, a Trainer hook).

Each rank's loss is the mean over its local tokens (every rank holds as many), so the
mean over dp x cp of the ranks' losses and gradients is the global batch's: the data
parallel wrapping already reduces gradients and averages losses over dp x cp.

With tensor parallel each rank runs its heads/tp query heads and kv_heads/tp kv heads
through the ring of its own cp group (the ranks that hold the same heads). With
sequence parallel the local seq_len/cp tokens are further cut by tp between the
attention and MLP halves; attention gathers them back first, so the ring always sees
this rank's whole head-tail shard. `apply_context_parallel` touches only the blocks
a module holds, so it runs the same on a whole model or on one pipeline stage.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autotune_kernels.attention import head_tail_positions, head_tail_shard, ring_attention


class RingCoreAttention(nn.Module):
    """Causal ring attention over a cp group, over the same sliding window if the layer
    has one; a drop-in for the model's CoreAttention."""

    def __init__(self, cp_mesh: DeviceMesh, window: int | None = None):
        super().__init__()
        self.group = cp_mesh.get_group()
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, _ = ring_attention(q, k, v, self.group, causal=True, window=self.window)
        return out


def apply_context_parallel(stage: nn.Module, cp_mesh: DeviceMesh, seq_len: int) -> None:
    """Swap every block's attention core for the ring and give it this rank's positions.

    `stage` is a (meta-device) model or pipeline stage; positions are made on the
    mesh's device, since they are neither parameters nor buffers that to_empty moves.
    A module that needs statistics of whole sequences (the MoE balance loss) exposes a
    `sequence_group` and gets the cp group: its sequence's tokens live on those ranks."""
    positions = head_tail_positions(seq_len, cp_mesh.size(), cp_mesh.get_local_rank(),
                                    device=torch.device(cp_mesh.device_type))
    for block in stage.layers.values():
        block.attention.core = RingCoreAttention(cp_mesh, block.attention.core.window)
        block.attention.positions = positions
        if hasattr(block.mlp, "sequence_group"):
            block.mlp.sequence_group = cp_mesh.get_group()


class HeadTailSharder:
    """The Trainer's `shard_batch` hook: this cp rank's head-tail shard of a micro-batch's
    inputs and labels (the same tokens whose positions the blocks were given)."""

    def __init__(self, cp_mesh: DeviceMesh):
        self.size, self.rank = cp_mesh.size(), cp_mesh.get_local_rank()

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return head_tail_shard(inputs, self.size, self.rank), head_tail_shard(labels, self.size, self.rank)
