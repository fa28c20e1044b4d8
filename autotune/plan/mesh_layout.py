"""The process grid of a layout, pure: dim order, every named group as (size, stride).

The runtime's DeviceMesh (runtime/mesh.py) and the estimator's links (which groups stay
inside a node) are both built from this, so they cannot disagree.

Mesh dims, outermost first: pp, dp_replicate, dp_shard, cp, tp. tp is innermost so
that a TP group is neighbouring ranks (inside one node); pp outermost so that stage
boundaries may cross nodes. Named groups that span several dims are flattened views:

    dp          = dp_replicate x dp_shard   the data-parallel ranks (batch split)
    dp_cp       = dp x cp                   ranks that see different tokens: loss average,
                                            gradient reduction of dense parameters
    dp_shard_cp = dp_shard x cp             FSDP sharding of dense parameters under CP

Expert parallel is carved from dp_shard x cp rather than added as a dimension: the
MoE layers cut those ranks into (edp_shard, ep) with ep innermost (its ranks tp apart,
so inside a node whenever ep * tp fits), and the world size stays pp * dp * cp * tp:

    ep          the ranks that exchange tokens by all-to-all, each holding experts/ep
    edp_shard   dp_shard x cp / ep          FSDP sharding of the routed experts
    edp         dp_replicate x edp_shard    the ranks that hold the same experts: their
                                            gradients are reduced over these

An ep group may span cp ranks (ep = 2, cp = 2: the two halves of every sequence go to
different expert ranks): routing is per token, so that changes nothing.

A group's members are `stride` ranks apart: the product of the sizes of the dims
inside its innermost one.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # layout.py imports this module
    from autotune.plan.layout import Layout

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Flattened views of neighbouring dims, by name.
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
}
# EP's carving of dp_shard_cp, outer dim first.
EXPERT_DIMS = ("edp_shard", "ep")


class Group(NamedTuple):
    """A communicator: its size and the rank distance between neighbouring members."""

    size: int
    stride: int

    def inside_node(self, gpus_per_node: int) -> bool:
        """Whether every copy of the group lies inside one node of `gpus_per_node` GPUs (the
        estimator passes the scale-up domain: NVLink's reach, not a host's)."""
        span = self.size * self.stride
        return span <= gpus_per_node and gpus_per_node % span == 0

    def members_per_node(self, gpus_per_node: int) -> int:
        if self.inside_node(gpus_per_node):
            return self.size
        return max(1, gpus_per_node // self.stride) if gpus_per_node % self.stride == 0 else 1


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of a layout, the mesh shape they make and the groups in it."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def from_layout(cls, layout: "Layout") -> "ParallelDims":
        return cls(pp=layout.pp, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard,
                   cp=layout.cp, tp=layout.tp, ep=layout.ep)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in DIM_NAMES)

    def stride(self, dim: str) -> int:
        """Rank distance between neighbours along one mesh dim."""
        return math.prod(getattr(self, d) for d in DIM_NAMES[DIM_NAMES.index(dim) + 1:])

    @property
    def expert_shape(self) -> tuple[int, int]:
        """(edp_shard, ep): EP's carving of dp_shard x cp."""
        return self.dp_shard * self.cp // self.ep, self.ep

    def group(self, name: str) -> Group:
        """Size and stride of a named group: a mesh dim, a flattened view or EP's groups."""
        if name in DIM_NAMES:
            return Group(getattr(self, name), self.stride(name))
        if name in FLATTENED:
            dims = FLATTENED[name]
            return Group(math.prod(getattr(self, d) for d in dims), self.stride(dims[-1]))
        edp_shard, ep = self.expert_shape
        inner = self.stride("cp")  # dp_shard_cp's stride, where the carving starts
        if name == "ep":
            return Group(ep, inner)
        if name == "edp_shard":
            return Group(edp_shard, inner * ep)
        if name == "edp":
            return Group(self.dp_replicate * edp_shard, inner * ep)
        raise KeyError(f"no mesh group named {name!r}")

    def groups(self) -> dict[str, Group]:
        names = DIM_NAMES + tuple(FLATTENED) + EXPERT_DIMS + ("edp",)
        return {name: self.group(name) for name in names}

    # -- which dimensions are on --------------------------------------------------------
    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_enabled(self) -> bool:
        """Ranks see different tokens (dp x cp > 1): losses and gradients are averaged."""
        return self.dp * self.cp > 1

    @property
    def hsdp_enabled(self) -> bool:
        """State sharded within dp_shard x cp and replicated over dp_replicate > 1."""
        return self.dp_replicate > 1

    @property
    def state_shards(self) -> int:
        """Ranks over which sharded state (zero >= 1) is cut: dp_shard x cp."""
        return self.dp_shard * self.cp


@functools.lru_cache(maxsize=4096)
def mesh_groups(dims: ParallelDims) -> dict[str, Group]:
    """ParallelDims.groups, kept per set of degrees: the estimator asks for it for every
    layout it prices, and many layouts share their degrees. Read it, do not change it."""
    return dims.groups()
