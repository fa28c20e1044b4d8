"""ParallelDims: the degrees of a layout and the device mesh they make.

Mesh dims, outermost first: pp, dp_replicate, dp_shard, cp, tp. tp is innermost so
that a TP group is neighbouring ranks (inside one node); pp outermost so that stage
boundaries may cross nodes. Flattened views serve the collectives that span several
dims:

    dp        = dp_replicate x dp_shard   the data-parallel ranks (batch split)
    dp_cp     = dp x cp                   ranks that see different tokens: loss average,
                                          gradient reduction of dense parameters
    dp_shard_cp = dp_shard x cp           FSDP sharding of dense parameters under CP

Expert parallel is carved from dp_shard x cp rather than added as a dimension: the
MoE layers cut those ranks into (edp_shard, ep) with ep innermost (its ranks tp
apart, so inside a node whenever ep * tp fits), and the world size stays pp * dp *
cp * tp:

    ep          the ranks that exchange tokens by all-to-all, each holding experts/ep
    edp_shard   dp_shard x cp / ep        FSDP sharding of the routed experts
    edp         dp_replicate x edp_shard  the ranks that hold the same experts: their
                                          gradients are reduced over these

An ep group may span cp ranks (ep = 2, cp = 2: the two halves of every sequence
go to different expert ranks): routing is per token, so that changes nothing.

This is the only file that touches private DeviceMesh APIs (`_flatten`,
`_unflatten`, `_concatenate`), so a change in torch is mended in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autotune.layout import Layout

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int

    @classmethod
    def from_layout(cls, layout: Layout) -> "ParallelDims":
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

    def build_mesh(self, device_type: str) -> "Meshes":
        root = init_device_mesh(device_type, self.shape(), mesh_dim_names=DIM_NAMES)
        named = {name: root[name] for name in DIM_NAMES}
        for name, dims in FLATTENED.items():
            named[name] = root[dims]._flatten(name)
        experts = named["dp_shard_cp"]._unflatten(0, (self.dp_shard * self.cp // self.ep, self.ep),
                                                  ("edp_shard", "ep"))
        named["ep"], named["edp_shard"] = experts["ep"], experts["edp_shard"]
        named["edp"] = DeviceMesh._concatenate([named["dp_replicate"], named["edp_shard"]])._flatten("edp")
        return Meshes(root=root, named=named)


# Flattened views, kept by name (torch no longer slices flattened dims from the root).
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
}


@dataclass(frozen=True)
class Meshes:
    """The root mesh and every named 1-D view of it: `meshes["tp"]`, `meshes["dp_cp"]`."""

    root: DeviceMesh
    named: dict

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.named[name]

    def size(self, name: str) -> int:
        return self.named[name].size()

    def local_rank(self, name: str) -> int:
        return self.named[name].get_local_rank()

    def hsdp(self) -> DeviceMesh:
        """The 2-D (dp_replicate, dp_shard_cp) mesh of HSDP: FSDP shards over the second
        dim and replicates over the first."""
        return DeviceMesh._concatenate([self.named["dp_replicate"], self.named["dp_shard_cp"]])

    def expert_hsdp(self) -> DeviceMesh:
        """HSDP's 2-D mesh for the routed experts: (dp_replicate, edp_shard)."""
        return DeviceMesh._concatenate([self.named["dp_replicate"], self.named["edp_shard"]])

    def describe(self) -> str:
        """The process grid, printable: which global ranks form each group of this rank."""
        lines = [f"mesh {dict(zip(DIM_NAMES, self.root.shape))}"]
        for name, mesh in self.named.items():
            lines.append(f"  {name:<12} size {mesh.size():>3}  ranks {mesh.mesh.flatten().tolist()}")
        return "\n".join(lines)
