"""Expert parallel: each rank of an ep group holds num_experts / ep of every MoE layer's
routed experts, and tokens travel to their experts and back by all-to-all.

The ep group is carved from dp_shard x cp (runtime/mesh.py): its ranks see different
tokens, so each routes its own tokens and sends every expert's block to the rank
that holds it. Per MoE layer and micro-batch, around the experts' grouped matmul:

    1. exchange counts   all-to-all of the per-expert token counts (ep x local
                         experts), so every rank knows how many rows it will get
                         from each peer for each of its experts (the splits are
                         uneven and change every step: dropless routing)
    2. dispatch          all-to-all of the tokens, sorted by expert, with those splits
                         (torch's autograd-aware all_to_all_single: its backward is the
                         reverse all-to-all of the gradients)
    3. compute           the rows arrive grouped by source rank; they are re-sorted to
                         local-expert-major order for one grouped matmul
    4. combine           the reverse sort and the reverse all-to-all bring every output
                         row back to the rank and position its token came from

Steps 1-2 and 3-4 are forward pre- and post-hooks on the experts module (torch's
`distribute_module`, which also shards the expert weights, dim 0, over the ep mesh),
so the MoE block runs unchanged and its parameter names stay those of one process.

Gradients. An expert's weight gradient on an ep rank sums the contributions of all ep
ranks' tokens it served; the ranks holding the same experts (edp = dp_replicate x
dp_shard x cp / ep) then reduce theirs. The mean over the global batch needs a
division by the full data degree dp x cp = ep x edp, not only by the edp ranks FSDP
averages over, so the experts' FSDP unit divides by ep once more
(`divide_expert_gradients`). FSDP shards (zero 2/3) or replicates (zero 0/1) the
experts over edp as its own unit per layer, the rest of the block over dp_shard x cp
(runtime/parallel/dp.py).

Tensor parallel cuts attention and the dense MLPs; an MoE block stays whole on every
tp rank (each tp rank of an ep group runs the same routing and exchanges with the
peers of its own tp index), so ep composes with tp without cutting experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from autotune.runtime.moe import moe_layers
from autotune.runtime.torch_compat import all_to_all_single_autograd
from autotune_kernels.moe import inverse_permutation


class TokenExchange:
    """Dispatch and combine for one MoE layer's experts; holds the splits between them."""

    def __init__(self, num_experts: int, mesh: DeviceMesh):
        self.ranks = mesh.size()
        self.local_experts = num_experts // self.ranks
        self.group = mesh.get_group()
        self.pending: tuple | None = None

    def dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        """(rows sorted by global expert, counts [experts]) -> (rows for this rank's experts,
        sorted by local expert, and their counts [local experts])."""
        routed, counts = inputs
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        by_source = received.view(self.ranks, self.local_experts)  # [source rank, local expert]
        send = counts.view(self.ranks, self.local_experts).sum(dim=1).tolist()
        receive = by_source.sum(dim=1).tolist()
        rows = all_to_all_single_autograd(routed, receive, send, self.group)
        # Arrived rows are blocks (source, local expert); sort them to (local expert, source).
        block = torch.repeat_interleave(torch.arange(received.numel(), device=received.device), received)
        order = ((block % self.local_experts) * self.ranks + block // self.local_experts).argsort(stable=True)
        self.pending = (send, receive, order)
        return rows[order], by_source.sum(dim=0)

    def combine(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """Expert outputs in local-expert order -> this rank's rows, in its routed order."""
        send, receive, order = self.pending
        self.pending = None
        return all_to_all_single_autograd(out[inverse_permutation(order)], send, receive, self.group)


def shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Each ep rank keeps a contiguous num_experts / ep of the stacked expert weights."""
    for param_name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard the routed experts of every MoE block of `model` over `ep_mesh` and route
    their tokens by all-to-all (on the meta device, before FSDP)."""
    for layer in moe_layers(model).values():
        exchange = TokenExchange(layer.num_experts, ep_mesh)
        distribute_module(layer.experts, ep_mesh, partition_fn=shard_experts,
                          input_fn=exchange.dispatch, output_fn=exchange.combine)


def divide_expert_gradients(experts: FSDPModule, ep: int) -> None:
    """FSDP averages the experts' gradients over the edp ranks that hold them; divide the
    result by ep more, so that the divisor is the full data degree dp x cp (module
    docstring). The hook runs on the reduced shard, in place: no copy of the gradients
    (FSDP's own custom divisor makes one where a group has a single rank, and needs an
    op gloo lacks elsewhere)."""
    experts.set_all_reduce_hook(lambda reduced: reduced.div_(ep))


def token_imbalance(model: nn.Module | list[nn.Module], mesh, skip_steps: int) -> dict[str, float] | None:
    """Per MoE layer: max over ep ranks / mean over ep ranks of the tokens each received
    in a step, averaged over the steps after `skip_steps`; None without expert parallel.

    A rank received what every rank of its ep group routed to its experts, so the
    groups sum their per-expert counts; ranks of all groups (and pipeline stages)
    are then compared together, as the slowest expert rank holds up every step.
    """
    if not mesh.dims.ep_enabled:
        return None
    ranks, me = mesh.size("ep"), mesh.local_rank("ep")
    mine = {}
    for name, layer in moe_layers(model).items():
        counts = torch.stack(layer.counts_per_step[skip_steps:])  # [steps, experts], routed by this rank
        dist.all_reduce(counts, group=mesh["ep"].get_group())
        mine[name] = counts.view(len(counts), ranks, -1).sum(dim=-1)[:, me].tolist()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    imbalance = {}
    for name in sorted(set().union(*everyone), key=int):
        received = torch.tensor([ranks_layers[name] for ranks_layers in everyone if name in ranks_layers],
                                dtype=torch.float64)  # [ranks, steps]
        imbalance[name] = (received.max(dim=0).values / received.mean(dim=0)).mean().item()
    return imbalance
