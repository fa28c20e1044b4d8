"""Data parallel for zero 0 and 1: what Megatron-LM's DDP and distributed optimizer hold.

It holds the parameters the model computes in, one flat fp32 gradient buffer
(`main_grad`), fp32 master weights (bf16 parameters only) and AdamW's two states, the
last two sharded over the data ranks at zero 1: the bytes per parameter that
estimate/memory.py prices (its docstring has the table, as Megatron-LM's).

torch has no such data parallel that composes with DTensor tensor parallel (DDP does
not; FSDP2's replicate keeps fp32 parameters beside a full working copy: 4 + 2 bytes
more than this), so it is built here, small:

- Gradients: a post-accumulate-grad hook adds each parameter's gradient (TP-local) into
  its fp32 view of a flat buffer and frees it at once. The buffer is cut into buckets in
  backward order; on the step's last micro-batch a bucket whose gradients are all in is
  reduced at once (async), overlapping the rest of the backward; `finish_backward`
  launches what is left (a parameter that got no gradient), waits, and divides by the
  data degree dp x cp (expert-parallel experts are reduced over edp = dp x cp / ep, the
  ranks that hold the same experts, and divided by dp x cp too: their gradient on an ep
  rank already sums the tokens of all ep ranks).
- A gradient that is a partial sum over tp (the norms' under sequence parallel, QK-norm's)
  is added as it is and summed over tp once per step, all of them in one all-reduce, as
  Megatron-LM's finalize_model_grads does (redistributed at each micro-batch it costs 2
  per layer and micro-batch).
- zero 0 all-reduces; zero 1 reduce-scatters (NCCL; gloo has no reduce-scatter and
  all-reduces), each rank keeping 1/N of each bucket, padded to divide by N.
- The optimizer: torch's fused AdamW over fp32 masters, the whole buffer's parameters at
  zero 0, this rank's 1/N of each bucket at zero 1 (as pieces of the parameters it
  overlaps). After the step the masters are written back into the parameters (cast to
  bf16) and, at zero 1, every bucket's parameters are all-gathered from their owners.
- Under pipeline parallel torch's schedule runs the micro-batches: every gradient is
  accumulated and the reduction runs after the schedule (`finish_backward`), as FSDP's
  does there. torch's split backwards (zero bubble) write weight gradients into `.grad`
  themselves, past the hook: those are folded into the buffer before reducing.

AdamW is element-wise, so zero 1 applies to each element exactly zero 0's arithmetic.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

BUCKET_ELEMENTS = 1 << 24  # fp32 gradient elements per bucket: 64 MiB, reduced as one collective


class _Done:
    """The reduction of a bucket over one rank: nothing to wait for."""

    def wait(self) -> None:
        pass


NOTHING_TO_WAIT_FOR = _Done()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's storage of a (possibly DTensor) parameter or gradient."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass
class Bucket:
    """A contiguous range of a flat buffer: the parameters it covers and its reduction."""

    start: int
    end: int
    params: list[int]  # indices into the group's parameters
    pending: int = 0  # gradients still to arrive in the syncing micro-batch
    work: object = None  # the async collective in flight


@dataclass
class ParamGroup:
    """Parameters that reduce over one mesh: their flat fp32 gradient buffer, buckets and,
    for this rank, the pieces of them its optimizer updates."""

    params: list[nn.Parameter]
    reduce_mesh: DeviceMesh  # the ranks that hold the same parameters (dp_cp or edp)
    shard_mesh: DeviceMesh | None  # zero 1: the ranks that split the optimizer (dp_shard_cp or edp_shard)
    divisor: int  # the data degree dp x cp
    offsets: list[int] = field(default_factory=list)
    buckets: list[Bucket] = field(default_factory=list)
    grads: torch.Tensor | None = None
    partial: set[int] = field(default_factory=set)  # parameters whose gradients are partial sums over tp


class DataParallel:
    """zero 0 / 1 over a rank's model parts (module docstring). The trainer calls
    `before_microbatch(last)` before each micro-batch's backward (not under PP),
    `finish_backward()` after the step's last one, then clips with `grad_norm` and
    `scale_gradients`; `optimizer` is the fused AdamW over the masters.

    `param_groups()` gives [(parameters, reduce mesh, shard mesh or None)]: called before
    and after the parameters are cast to the compute dtype (the cast may make new
    parameter objects)."""

    def __init__(self, parts: list[nn.Module], param_groups, divisor: int, tp: int, compute_dtype: torch.dtype,
                 grad_dtype: torch.dtype = torch.float32, **adamw_options):
        self.parts, self.tp, self.compute_dtype, self.grad_dtype = parts, tp, compute_dtype, grad_dtype
        self.syncing = False
        device = next(p for part in parts for p in part.parameters()).device
        self.groups = [self._group(params, reduce_mesh, shard_mesh, divisor, device)
                       for params, reduce_mesh, shard_mesh in param_groups() if params]
        masters = [self._param_piece(where).float().clone() for where in self._pieces()] \
            if compute_dtype != torch.float32 else None
        if compute_dtype != torch.float32:  # the masters keep the fp32 values: the model computes in its dtype
            for part in parts:
                part.to(compute_dtype)
            for group, (params, _, _) in zip(self.groups, [g for g in param_groups() if g[0]]):
                group.params = list(reversed(params))
        self.masters: list[tuple[torch.Tensor, torch.Tensor]] = []  # (master, the parameter piece it sets)
        for k, where in enumerate(self._pieces()):
            piece = self._param_piece(where)
            self.masters.append((piece if masters is None else masters[k], piece))
        # The reduced gradient of each piece, in fp32, as the optimizer reads it: views of an
        # fp32 buffer; of a bf16 / fp16 one, copies finish_backward makes and the step frees.
        self.piece_grads = self._buffer_pieces() if grad_dtype == torch.float32 else None
        self.optimizer = torch.optim.AdamW([master for master, _ in self.masters], fused=True, **adamw_options)
        me = weakref.ref(self)  # as the gradient hooks do (_hook)
        self.optimizer.register_step_pre_hook(lambda *args: me()._attach_gradients())
        self.optimizer.register_step_post_hook(lambda *args: me()._after_step())
        self.where = {id(param): (group, i) for group in self.groups for i, param in enumerate(group.params)}
        for group in self.groups:
            for i, param in enumerate(group.params):
                param.register_post_accumulate_grad_hook(self._hook(group, i))

    def gradient(self, param: nn.Parameter) -> torch.Tensor:
        """The reduced gradient in the buffer for a parameter (its dtype), shaped like it (a
        DTensor where the parameter is one). At zero 1 on NCCL only this rank's slice of
        each bucket is reduced; on gloo, which all-reduces, all of it."""
        group, i = self.where[id(param)]
        view = group.grads[group.offsets[i]:group.offsets[i] + local(param).numel()].view(local(param).shape)
        if isinstance(param, DTensor):
            return DTensor.from_local(view, param.device_mesh, param.placements, run_check=False)
        return view

    # -- layout of the buffers ---------------------------------------------------------------
    def _group(self, params, reduce_mesh, shard_mesh, divisor, device) -> ParamGroup:
        """Parameters in backward order (the reverse of registration), laid out in buckets
        padded to divide by the shard count."""
        group = ParamGroup(list(reversed(params)), reduce_mesh, shard_mesh, divisor)
        ranks = shard_mesh.size() if shard_mesh is not None else 1
        offset, bucket = 0, Bucket(0, 0, [])
        for i, param in enumerate(group.params):
            numel = local(param).numel()
            group.offsets.append(offset)
            bucket.params.append(i)
            offset += numel
            if offset - bucket.start >= BUCKET_ELEMENTS or i == len(group.params) - 1:
                offset = bucket.start + math.ceil((offset - bucket.start) / ranks) * ranks
                bucket.end = offset
                group.buckets.append(bucket)
                bucket = Bucket(offset, offset, [])
        group.grads = torch.zeros(offset, dtype=self.grad_dtype, device=device)
        return group

    def _my_pieces(self, group: ParamGroup):
        """(parameter index, start, end) in the flat buffer of what this rank's optimizer
        updates: everything at zero 0, its 1/N of each bucket at zero 1."""
        ranks = group.shard_mesh.size() if group.shard_mesh is not None else 1
        me = group.shard_mesh.get_local_rank() if group.shard_mesh is not None else 0
        for bucket in group.buckets:
            width = (bucket.end - bucket.start) // ranks
            lo, hi = bucket.start + me * width, bucket.start + (me + 1) * width
            for i in bucket.params:
                start = max(lo, group.offsets[i])
                end = min(hi, group.offsets[i] + local(group.params[i]).numel())
                if start < end:
                    yield i, start, end

    def _pieces(self):
        """(group, parameter index, start, end) of every piece this rank's optimizer updates."""
        for group in self.groups:
            for i, start, end in self._my_pieces(group):
                yield group, i, start, end

    def _buffer_pieces(self) -> list[torch.Tensor]:
        return [group.grads[start:end] for group, _, start, end in self._pieces()]

    def _param_piece(self, where) -> torch.Tensor:
        group, i, start, end = where
        return local(group.params[i]).detach().view(-1)[start - group.offsets[i]:end - group.offsets[i]]

    # -- gradients -----------------------------------------------------------------------------
    def _hook(self, group: ParamGroup, i: int):
        """The parameter's post-accumulate-grad hook. It reaches this object and its buffers
        through a weak reference only: a parameter's hooks live in C++, where Python's
        collector cannot see a cycle back through them, and a trial's model must die with it."""
        me, g = weakref.ref(self), self.groups.index(group)
        start, numel = group.offsets[i], local(group.params[i]).numel()
        b = next(k for k, bucket in enumerate(group.buckets) if i in bucket.params)

        @torch.no_grad()
        def accumulate(param: nn.Parameter) -> None:
            owner = me()
            group = owner.groups[g]
            group.grads[start:start + numel].add_(owner._local_part(group, i, param).reshape(-1))
            param.grad = None
            if owner.syncing:
                bucket = group.buckets[b]
                bucket.pending -= 1
                if bucket.pending == 0:
                    owner._launch(group, bucket)
        return accumulate

    def before_microbatch(self, last: bool) -> None:
        """The next backward is the step's last: reduce each bucket as it completes."""
        self.syncing = last
        if last:
            for group in self.groups:
                for bucket in group.buckets:
                    bucket.pending, bucket.work = len(bucket.params), None

    def _launch(self, group: ParamGroup, bucket: Bucket) -> None:
        if group.reduce_mesh.size() == 1:
            bucket.work = NOTHING_TO_WAIT_FOR
            return
        grads = group.grads[bucket.start:bucket.end]
        if group.shard_mesh is not None and dist.get_backend(group.reduce_mesh.get_group()) != "gloo" \
                and group.shard_mesh.size() == group.reduce_mesh.size():
            width = (bucket.end - bucket.start) // group.shard_mesh.size()
            mine = grads[group.shard_mesh.get_local_rank() * width:][:width]
            bucket.work = dist.reduce_scatter_tensor(mine, grads, group=group.shard_mesh.get_group(), async_op=True)
        else:
            bucket.work = dist.all_reduce(grads, group=group.reduce_mesh.get_group(), async_op=True)

    def _local_part(self, group: ParamGroup, i: int, param: nn.Parameter) -> torch.Tensor:
        """What the buffer adds of a gradient: its local part, a partial sum as it is (the
        norms' under sequence parallel, QK-norm's under tp), summed over tp once per step
        in finish_backward as Megatron does, not once per micro-batch."""
        if is_partial_sum(param):
            group.partial.add(i)
            return param.grad.to_local()
        return local_gradient(param)

    def _sum_partial_gradients(self, group: ParamGroup) -> None:
        """One all-reduce over tp of every partial-sum gradient of the group, as one flat tensor."""
        if not group.partial:
            return
        indices = sorted(group.partial)  # the same on every tp rank: they train the same parameters
        slices = [group.grads[group.offsets[i]:group.offsets[i] + local(group.params[i]).numel()] for i in indices]
        flat = torch.cat(slices)
        dist.all_reduce(flat, group=group.params[indices[0]].device_mesh.get_group())
        for piece, summed in zip(slices, flat.split([piece.numel() for piece in slices])):
            piece.copy_(summed)

    @torch.no_grad()
    def fold_gradients(self) -> None:
        """Take gradients written into `.grad` past the hook (the weight steps of torch's split
        backwards) into the buffer, and free them."""
        for group in self.groups:
            for i, param in enumerate(group.params):
                if param.grad is not None:
                    numel = local(param).numel()
                    group.grads[group.offsets[i]:group.offsets[i] + numel].add_(
                        self._local_part(group, i, param).reshape(-1))
                    param.grad = None

    @torch.no_grad()
    def finish_backward(self) -> None:
        """Reduce what the hooks did not, wait for every reduction, divide by dp x cp; a
        bf16 / fp16 buffer's pieces are then copied into fp32 for clipping and the step."""
        self.fold_gradients()
        for group in self.groups:
            for bucket in group.buckets:
                if bucket.work is None:
                    self._launch(group, bucket)
            for bucket in group.buckets:
                bucket.work.wait()
                bucket.work = None
            self._sum_partial_gradients(group)  # sums commute: over dp first, then over tp
            group.grads.div_(group.divisor)
        if self.grad_dtype != torch.float32:
            self.piece_grads = [piece.float() for piece in self._buffer_pieces()]
        self.syncing = False

    def squared_norm(self) -> torch.Tensor:
        """This rank's share of the squared L2 norm of the reduced gradients: each element
        counted once over the world (divided by the ranks holding the same copy), so a sum
        over every rank is the whole model's."""
        total = torch.zeros((), device=self.groups[0].grads.device)
        for (group, i, _, _), grad in zip(self._pieces(), self.piece_grads):
            copies = group.reduce_mesh.size() // (group.shard_mesh.size() if group.shard_mesh else 1)
            total += grad.square().sum() / (copies * tp_copies(group.params[i], self.tp))
        return total

    def grad_norm(self, pipeline_group=None) -> torch.Tensor:
        """The L2 norm of the whole model's reduced gradients, the same on every rank."""
        square = self.squared_norm()
        dist.all_reduce(square)
        return square.sqrt()

    def scale_gradients(self, factor: torch.Tensor) -> None:
        if self.grad_dtype == torch.float32:
            for group in self.groups:
                group.grads.mul_(factor)
        else:
            torch._foreach_mul_(self.piece_grads, factor)

    def discard_gradients(self) -> None:
        """A skipped step (fp16 overflow): zero the buffers the optimizer would have read."""
        for group in self.groups:
            group.grads.zero_()
        if self.grad_dtype != torch.float32:
            self.piece_grads = None

    # -- the optimizer step ----------------------------------------------------------------------
    def _attach_gradients(self) -> None:
        """Each master's gradient is its piece's fp32 gradient (zero_grad may have unset it)."""
        for (master, _), grad in zip(self.masters, self.piece_grads):
            master.grad = grad

    @torch.no_grad()
    def _after_step(self) -> None:
        if self.compute_dtype != torch.float32:
            for master, piece in self.masters:
                piece.copy_(master)
        if self.grad_dtype != torch.float32:  # the fp32 copies live from the reduction to the step
            self.piece_grads = None
            for master, _ in self.masters:
                master.grad = None
        for group in self.groups:
            group.grads.zero_()
            if group.shard_mesh is not None and group.shard_mesh.size() > 1:
                self._gather_parameters(group)

    def _gather_parameters(self, group: ParamGroup) -> None:
        """zero 1: every bucket's parameters from the ranks that updated them."""
        ranks, me = group.shard_mesh.size(), group.shard_mesh.get_local_rank()
        for bucket in group.buckets:
            width = (bucket.end - bucket.start) // ranks
            dtype = local(group.params[bucket.params[0]]).dtype
            everyone = torch.empty(bucket.end - bucket.start, dtype=dtype, device=group.grads.device)
            for i in bucket.params:
                lo, hi = group.offsets[i], group.offsets[i] + local(group.params[i]).numel()
                start, end = max(lo, bucket.start + me * width), min(hi, bucket.start + (me + 1) * width)
                if start < end:
                    everyone[start - bucket.start:end - bucket.start] = \
                        local(group.params[i]).view(-1)[start - lo:end - lo]
            mine = everyone[me * width:(me + 1) * width].clone()
            dist.all_gather_into_tensor(everyone, mine, group=group.shard_mesh.get_group())
            for i in bucket.params:
                lo = group.offsets[i]
                flat = local(group.params[i]).detach().view(-1)
                flat.copy_(everyone[lo - bucket.start:lo - bucket.start + flat.numel()])


def is_partial_sum(param: nn.Parameter) -> bool:
    """A replicated parameter on a one-dimensional (tp) mesh whose gradient is a partial sum
    over that mesh: each rank's covers its own tokens or heads."""
    grad = param.grad
    return isinstance(grad, DTensor) and param.device_mesh.mesh_dim_names == ("tp",) \
        and grad.placements[0].is_partial() and param.placements[0].is_replicate()


def local_gradient(param: nn.Parameter) -> torch.Tensor:
    """This rank's part of a parameter's gradient, laid out as the parameter is: a DTensor
    gradient may come back with other placements (a vocabulary-parallel embedding's as a
    whole table, sequence parallel's norms' as partial sums), and is redistributed first."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return local(grad)


def tp_copies(param: nn.Parameter, tp: int) -> int:
    """Tensor-parallel ranks that hold the same values of a parameter: 1 where tensor
    parallel shards it, tp where it is replicated (the norms) or left whole (MoE blocks,
    and the experts, which expert parallel shards on another mesh)."""
    if isinstance(param, DTensor) and "tp" in (param.device_mesh.mesh_dim_names or ()):
        dim = param.device_mesh.mesh_dim_names.index("tp")
        return 1 if param.placements[dim].is_shard() else tp
    return tp
