"""Sequence parallel keeps each half's input as its sequence shard, as Megatron-LM does.

Under sequence parallel the attention and the MLP all-gather their input to whole
sequences (tp.py). The column-parallel linears that read it save it for their weight
gradient, so under torch's plan every tensor-parallel rank keeps the whole gathered
sequence of both halves of every layer until its backward: 2 x tokens x hidden per
layer where the rank's own share is 1/tp of it (at tp 8 about 1.8x the activations
Megatron keeps). Megatron saves the shard and all-gathers it again in backward
(`--sequence-parallel`'s weight-gradient path). Here the same through saved-tensor
hooks: while a half runs forward, a tensor autograd saves that is (a view of) the
gathered input is packed as a reference to the shard, and the backward's first unpack
gathers it again, once for all the linears that share it (wq, wk, wv; gate and up; the
router). The regathered input lives until the last of them has run its backward.

Only where nothing else owns the saved tensors: recompute none and selective (whose
checkpoint of the attention core nests inside). Under per-op and full recompute the
block's checkpoint decides what is kept, and a hook inside it would take its tensors
from it; there op recompute already regathers (recompute.py) and full keeps only the
block's input. Costs one more all-gather per half in backward, as Megatron's does.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autotune.runtime.torch_compat import local_tensor


class _Gathered:
    """One forward's gathered input: its shard, and the regathered copy once backward needs it."""

    def __init__(self, shard, gathered: torch.Tensor, mesh: DeviceMesh):
        self.shard = shard
        self.mesh = mesh
        self.storage = gathered.untyped_storage().data_ptr()  # never the tensor: it would stay alive
        self.device = gathered.device
        self.offset = gathered.storage_offset()
        self.regathered: torch.Tensor | None = None

    def full(self) -> torch.Tensor:
        if self.regathered is None:
            with torch.no_grad():
                shard = self.shard if isinstance(self.shard, DTensor) else \
                    DTensor.from_local(self.shard, self.mesh, (Shard(1),), run_check=False)
                self.regathered = shard.redistribute(self.mesh, (Replicate(),)).to_local()
        return self.regathered


class _Packed:
    """A saved tensor that is a view of the gathered input, kept as how to rebuild it."""

    def __init__(self, gathered: _Gathered, saved: torch.Tensor):
        local = local_tensor(saved)
        self.gathered = gathered
        self.view = (local.shape, local.stride(), local.storage_offset() - gathered.offset)
        self.spec = (saved.device_mesh, saved.placements, saved.shape, saved.stride()) \
            if isinstance(saved, DTensor) else None

    def unpack(self) -> torch.Tensor:
        full = self.gathered.full()
        local = full.as_strided(*self.view)
        if self.spec is None:
            return local
        mesh, placements, shape, stride = self.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class ShardSavingHalf:
    """Installed on an attention or MLP module whose input tp.py all-gathers."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh):
        self.mesh = mesh
        self.shard = None
        # The module holds this object (its forward); a strong reference back would make a
        # cycle that keeps a finished trial's model alive until the garbage collector runs.
        self.module = weakref.ref(module)
        module.register_forward_pre_hook(self.take_shard, prepend=True)  # before torch's gather
        module.forward = self.forward

    def inner_forward(self, *args, **kwargs):
        module = self.module()
        return type(module).forward(module, *args, **kwargs)

    def take_shard(self, module: nn.Module, args: tuple) -> None:
        self.shard = args[0]

    def forward(self, gathered: torch.Tensor, *args, **kwargs):
        """`gathered`: the whole sequence, a replicated DTensor (a plain tensor for MLA)."""
        shard, self.shard = self.shard, None
        if not torch.is_grad_enabled() or not local_tensor(gathered).is_contiguous():
            return self.inner_forward(gathered, *args, **kwargs)
        record = _Gathered(shard, local_tensor(gathered), self.mesh)

        def pack(saved: torch.Tensor):  # autograd keeps the hooks with what they saved: no tensor in here
            local = local_tensor(saved)
            if local.device == record.device and local.untyped_storage().data_ptr() == record.storage:
                return _Packed(record, saved)
            # Detached: a tensor kept with its autograd history would hold its own node (a
            # saved output) in a cycle that only a backward breaks; the data is the same.
            return saved.detach()

        def unpack(packed):
            return packed.unpack() if isinstance(packed, _Packed) else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return self.inner_forward(gathered, *args, **kwargs)


def save_sequence_shards(model: nn.Module, tp_mesh: DeviceMesh, recompute: str, recompute_layers: int) -> None:
    """Install ShardSavingHalf on every block the recompute mode leaves unchecked (module
    docstring): all of them under none and selective, those past the first
    `recompute_layers` under full with a count, none under op or whole full."""
    if recompute == "op" or (recompute == "full" and not recompute_layers):
        return
    names = list(model.layers)
    if recompute == "full":
        names = names[recompute_layers:]
    for name in names:
        block = model.layers[name]
        for half in (block.attention, block.mlp, getattr(block, "mamba", None)):  # a hybrid block has one
            if half is not None:
                ShardSavingHalf(half, tp_mesh)
