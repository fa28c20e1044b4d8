"""The device mesh of a layout: torch's DeviceMesh with every named group of
autotune/plan/mesh_layout.py (which says what each group is for).

`build_mesh` makes the root mesh in mesh_layout's dim order, then every flattened view
and EP's carving by name; `Meshes` hands them out (`meshes["tp"]`, `meshes["dp_cp"]`).
DeviceMesh's private APIs (flatten, unflatten, concatenate) are reached through
runtime/torch_compat.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autotune.plan.mesh_layout import DIM_NAMES, EXPERT_DIMS, FLATTENED, ParallelDims
from autotune.runtime.torch_compat import concatenate_meshes, flatten_mesh, unflatten_mesh


def mesh_for(layout, device_type: str) -> "Meshes":
    """The meshes of a layout's degrees."""
    return build_mesh(ParallelDims.from_layout(layout), device_type)


def build_mesh(dims: ParallelDims, device_type: str) -> "Meshes":
    root = init_device_mesh(device_type, dims.shape(), mesh_dim_names=DIM_NAMES)
    named = {name: root[name] for name in DIM_NAMES}
    for name, parts in FLATTENED.items():
        named[name] = flatten_mesh(root[parts], name)
    experts = unflatten_mesh(named["dp_shard_cp"], dims.expert_shape, EXPERT_DIMS)
    named.update({name: experts[name] for name in EXPERT_DIMS})
    named["edp"] = flatten_mesh(concatenate_meshes([named["dp_replicate"], named["edp_shard"]]), "edp")
    return Meshes(root=root, named=named, dims=dims)


@dataclass(frozen=True)
class Meshes:
    """The root mesh and every named 1-D view of it: `meshes["tp"]`, `meshes["dp_cp"]`."""

    root: DeviceMesh
    named: dict
    dims: ParallelDims

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.named[name]

    def size(self, name: str) -> int:
        return self.named[name].size()

    def local_rank(self, name: str) -> int:
        return self.named[name].get_local_rank()

    def hsdp(self) -> DeviceMesh:
        """The 2-D (dp_replicate, dp_shard_cp) mesh of HSDP: FSDP shards over the second
        dim and replicates over the first."""
        return concatenate_meshes([self.named["dp_replicate"], self.named["dp_shard_cp"]])

    def expert_hsdp(self) -> DeviceMesh:
        """HSDP's 2-D mesh for the routed experts: (dp_replicate, edp_shard)."""
        return concatenate_meshes([self.named["dp_replicate"], self.named["edp_shard"]])

    def describe(self) -> str:
        """The process grid, printable: which global ranks form each group of this rank."""
        lines = [f"mesh {dict(zip(DIM_NAMES, self.root.shape))}"]
        for name, mesh in self.named.items():
            lines.append(f"  {name:<12} size {mesh.size():>3}  ranks {mesh.mesh.flatten().tolist()}")
        return "\n".join(lines)
