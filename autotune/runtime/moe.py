"""The Mixture-of-Experts block that replaces a layer's SwiGLU MLP (config `moe`).

    router    a linear map to one logit per expert; softmax; each token keeps its top_k
              experts (autotune_kernels.moe.route)
    experts   num_experts MLPs of the model's kind and width expert_ffn_hidden_size, stored
              as [experts, in, out] tensors (three gated, two plain) and run as grouped matmuls over the tokens
              sorted by expert; dropless: every token reaches its experts
    shared    num_shared_experts always-on MLPs (one MLP of their summed width)

Load balancing: the Switch Transformer loss, weighted by `aux_loss_weight`, added for
every MoE layer:

    aux = E / (k * T^2) * sum_e count_e * sum_t p_te  =  E * sum_e f_e * P_e

with f_e = count_e / (k T) the fraction of the T tokens' k choices that went to expert
e and P_e the mean router probability of e; it is 1 when routing is uniform. It is
computed per sequence and averaged over the sequences (the sequence-wise form of
DeepSeek-V3): a loss over the micro-batch would change with the micro-batch size,
and so with the layout, and the tuner's correctness oracle is that every layout
trains exactly as one process does.

How the loss enters training. The layer adds it through autograd itself, so that no
trainer (a plain loop or a pipeline schedule, whose loss function sees only the last
stage's output) has to collect it: the block's output passes through `AuxLoss`, an
identity whose backward also hands the loss's gradient, aux_loss_weight *
`aux_loss_scale`, to the router's probabilities. `aux_loss_scale` is what the trainer
multiplies its own loss by before backward (1 / micro-batches; 1 where a schedule
divides the gradients instead). The same backward records the term's value and the
expert counts once per micro-batch, so activation recompute, which runs the forward
again, does not count them twice. `end_step` hands the trainer the step's recorded
loss terms (so the reported loss includes them) and files the counts by step, from
which expert parallel reports its load imbalance.

Context parallel splits a sequence over ranks; it sets `sequence_group` to those
ranks, the counts of each sequence are summed over them, and each rank adds its
tokens' share of the sequence's loss (see balance_loss).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autotune.config import ModelConfig
from autotune.config.model_size import GATED_MLPS
from autotune.runtime.mlp import FeedForward, activation
from autotune_kernels.moe import expert_counts, grouped_matmul, permute, route, unpermute


class GroupedExperts(nn.Module):
    """num_experts MLPs of the model's kind (runtime/mlp.py), e.g. SwiGLU
    down(silu(x gate_e) * (x up_e)), for the block of x routed to e; the plain kinds
    (gelu, relu2) have no gate.

    Expert parallel keeps num_experts / ep of them on each rank (a DTensor sharded on
    dim 0); the grouped matmuls then run on the local ones.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, kind: str = "swiglu"):
        super().__init__()
        self.kind = kind
        self.gate = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size)) if kind in GATED_MLPS \
            else None
        self.up = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] in blocks of counts[e] rows per (local) expert e.

        Each weight is made local right before its matmul: autograd runs later-made
        nodes first, so each weight's gradient then reaches its parameter (and its
        temporary is freed) as soon as it is computed, not after all three."""
        gate = grouped_matmul(x, local(self.gate), counts) if self.gate is not None else None
        up = grouped_matmul(x, local(self.up), counts)
        return grouped_matmul(activation(self.kind, up, gate), local(self.down), counts)


def local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight (expert parallel makes it a DTensor)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def balance_loss(probabilities: torch.Tensor, experts: torch.Tensor, num_experts: int,
                 sequence_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The Switch balance loss per sequence, averaged over sequences (module docstring).

    probabilities [batch, seq, experts] (fp32), experts [batch, seq, k] the choices.
    With a `sequence_group` each rank holds seq of the group's seq*G tokens of every
    sequence: counts are summed over the group and each rank returns G times its
    tokens' part, E / (k T^2) * sum_e count_e * sum_{t here} p_te, so that the mean over
    the group's ranks (what data and context parallel average) is the loss of whole
    sequences, and so are its gradients.
    """
    batch, seq, k = experts.shape
    counts = torch.zeros(batch, num_experts, device=probabilities.device, dtype=probabilities.dtype)
    counts.scatter_add_(1, experts.reshape(batch, -1), counts.new_ones(batch, seq * k))
    shards = 1
    if sequence_group is not None:
        dist.all_reduce(counts, group=sequence_group)
        shards = dist.get_world_size(sequence_group)
    length = seq * shards
    per_sequence = num_experts / (k * length * length) * (counts * probabilities.sum(dim=1)).sum(dim=-1)
    return shards * per_sequence.mean()


class AuxLoss(torch.autograd.Function):
    """Identity on the block's output whose backward adds the balance loss's gradient,
    and records the loss term and the expert counts of this micro-batch on the layer."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, layer: "MoE", counts: torch.Tensor) -> torch.Tensor:
        ctx.layer, ctx.counts = layer, counts
        ctx.weight = layer.aux_loss_weight * layer.aux_loss_scale
        ctx.value = ctx.weight * aux.detach()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.layer.record(ctx.value, ctx.counts)
        return grad, torch.full((), ctx.weight, device=grad.device, dtype=torch.float32), None, None


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.num_experts, self.top_k, self.aux_loss_weight = moe.num_experts, moe.top_k, moe.aux_loss_weight
        self.router = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = GroupedExperts(moe.num_experts, cfg.hidden_size, moe.expert_ffn_hidden_size, cfg.mlp)
        self.shared = FeedForward(cfg.hidden_size, moe.num_shared_experts * moe.expert_ffn_hidden_size, cfg.mlp) \
            if moe.num_shared_experts else None
        self.aux_loss_scale = 1.0  # set by the trainer: see the module docstring
        self.sequence_group: dist.ProcessGroup | None = None  # set by context parallel
        self.step_aux: torch.Tensor | None = None  # this step's recorded loss terms
        self.step_counts: torch.Tensor | None = None  # this step's tokens per expert, [experts]
        self.counts_per_step: list[torch.Tensor] = []  # one [experts] per finished step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        probabilities, weights, chosen = route(self.router(tokens), self.top_k)
        counts = expert_counts(chosen, self.num_experts)
        routed, order = permute(tokens, chosen)
        out = unpermute(self.experts(routed, counts), order, weights)
        if self.shared is not None:
            out = out + self.shared(tokens)
        aux = balance_loss(probabilities.view(batch, seq, -1), chosen.view(batch, seq, -1), self.num_experts,
                           self.sequence_group)
        return AuxLoss.apply(out, aux, self, counts).view(batch, seq, hidden)

    @torch.no_grad()
    def record(self, value: torch.Tensor, counts: torch.Tensor) -> None:
        self.step_aux = value if self.step_aux is None else self.step_aux + value
        self.step_counts = counts if self.step_counts is None else self.step_counts + counts


def moe_layers(model: nn.Module | list[nn.Module]) -> dict[str, MoE]:
    """{layer index: its MoE block} of a model or of a rank's pipeline stages (a bare
    MoE block is keyed "")."""
    models = model if isinstance(model, (list, tuple)) else [model]
    layers = {}
    for part in models:
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                layers[name.split(".")[1] if name.startswith("layers.") else name] = module
    return layers


def set_aux_loss_scale(model: nn.Module | list[nn.Module], scale: float) -> None:
    """What the trainer multiplies its loss by before backward (1 / micro-batches)."""
    for layer in moe_layers(model).values():
        layer.aux_loss_scale = scale


def discard_step(model: nn.Module | list[nn.Module]) -> None:
    """Forget what the layers recorded since the last end_step: a forward and backward
    that belongs to no step (torch's pipeline metadata inference, see pp.Stage)."""
    for layer in moe_layers(model).values():
        layer.step_aux = layer.step_counts = None


def end_step(model: nn.Module | list[nn.Module], device: torch.device) -> torch.Tensor:
    """The balance-loss terms this rank's layers recorded in the step (0 for a dense
    model), to add to the step's loss; files each layer's expert counts of the step."""
    total = torch.zeros((), device=device)
    for layer in moe_layers(model).values():
        if layer.step_aux is not None:
            total += layer.step_aux
            layer.counts_per_step.append(layer.step_counts)
        layer.step_aux = layer.step_counts = None
    return total
