"""Every private torch API the runtime and its kernels use, in one place.

torch moves its underscored modules between releases; a torch upgrade mends this file
and nothing else. Each entry says what it is for.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os

import torch
from torch.distributed._functional_collectives import all_to_all_single_autograd  # noqa: F401 (EP's token exchange)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper  # noqa: F401 (recompute)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.pipelining import PipelineStage, schedules
from torch.utils._python_dispatch import is_traceable_wrapper_subclass  # noqa: F401 (DTensor owns no storage)

try:  # FSDP2's interface for a custom all-gather (parallel/gloo_release.py), torch >= 2.8
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as FsdpAllGather
except ImportError:  # pragma: no cover - an older torch keeps FSDP's own all-gather
    FsdpAllGather = object

try:  # the profiler's event-tree node kinds (allocation records)
    from torch._C._profiler import _EventType as ProfilerEventType
except ImportError:  # pragma: no cover - older layouts of the module
    from torch.profiler._utils import _EventType as ProfilerEventType  # noqa: F401


# -- CPU memory accounting (runtime/memory.py) --------------------------------------------------

def track_cpu_allocations() -> bool:
    """Turn on c10's `caffe2_report_cpu_memory_usage`, so that the CPU allocator counts every
    allocation and free on every thread in the running total the profiler's memory events
    carry; False where this torch build's c10 library does not export the flag."""
    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*")):
        try:
            flag = ctypes.c_bool.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_report_cpu_memory_usage")
        except (OSError, ValueError):
            continue
        flag.value = True
        return True
    return False


def storage_references(tensor: torch.Tensor) -> int:
    """How many references hold the tensor's storage, in c10 (every tensor or view on it,
    and what a collective's work object keeps): parallel/gloo_release.py waits on it."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def forget_process_groups() -> None:
    """Clear what DTensor memoises by sharding specs: propagation results and redistribution
    plans. A DeviceMesh compares equal to another of the same shape and names whatever
    process groups it holds, so in a process that runs one trial after another (the warm
    pool) a cached result can hand the next trial a mesh of the last one's destroyed groups
    ("Could not resolve the process group registered under the name N"). Called between
    trials; a few milliseconds of planning each trial pays again."""
    from torch.distributed.tensor import _redistribute, debug

    for clear in (getattr(debug, "_clear_sharding_prop_cache", None),  # each where this torch has it
                  getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
                  getattr(_redistribute, "clear_redistribute_planner_cache", None)):
        if clear is not None:
            clear()


# -- DeviceMesh: named views of the root mesh (runtime/mesh.py) -------------------------------

def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """One 1-D mesh over several dims of the root, kept by name."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A 1-D mesh cut into named dims (EP's carving of dp_shard x cp)."""
    return mesh._unflatten(0, sizes, names)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """Named 1-D meshes side by side as one multi-dim mesh (HSDP's (replicate, shard))."""
    return DeviceMesh._concatenate(meshes)


def resolve_process_group(group):
    """A process group from its registered name (torch custom ops take groups by name)."""
    return _resolve_process_group(group)


# -- DTensor --------------------------------------------------------------------------------------

def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor under a DTensor (itself for a plain tensor), without the autograd
    edge `to_local()` adds: saved-tensor hooks (parallel/sp_saved.py) compare storages."""
    return getattr(tensor, "_local_tensor", tensor)


# -- pipelining --------------------------------------------------------------------------------

class LeanPipelineStage(PipelineStage):
    """torch's PipelineStage with two changes, both through its private steps:

    - Receive buffers live from the moment a transfer is posted until the micro-batch has
      been handed to the stage, as Megatron-LM's do, not one per micro-batch for the whole
      run as torch allocates them (at 64 micro-batches of 8192 x 8192 bf16, 17 GB where
      the micro-batches in flight need a few). Received activations then live as the
      stage's inputs until their backward, received gradients through that backward.
    - `after_metadata_inference()` is called when torch cleans up after the real forward
      and backward by which it infers the stages' tensor shapes on the first step, and
      `after_weight_step()` after each weight step of a split backward (which writes its
      gradients into `.grad` itself, past any gradient hook).
    """

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        self.after_metadata_inference()

    def after_metadata_inference(self) -> None:
        """Override: forget what the inference's forward and backward recorded."""

    def backward_weight_one_chunk(self, *args, **kwargs):
        out = super().backward_weight_one_chunk(*args, **kwargs)
        self.after_weight_step()
        return out

    def after_weight_step(self) -> None:
        """Override: take the weight gradients the step has written."""

    def _setup_forward_recv_info(self, *args, **kwargs) -> None:
        super()._setup_forward_recv_info(*args, **kwargs)
        for infos in self.args_recv_info.values():
            _release(infos)

    def _setup_backward_recv_info(self, *args, **kwargs) -> None:
        super()._setup_backward_recv_info(*args, **kwargs)
        for infos in self.grad_recv_info.values():
            _release(infos)

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        _allocate(self.args_recv_info[fwd_chunk_id], self.device)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        if self.has_backward and not self.is_last:
            _allocate(self.grad_recv_info[bwd_chunk_id], self.device)
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def _retrieve_recv_activations(self, fwd_chunk_id: int):
        activations = super()._retrieve_recv_activations(fwd_chunk_id)
        _release(self.args_recv_info[fwd_chunk_id])
        return activations

    def _retrieve_recv_grads(self, bwd_chunk_id: int):
        grads = super()._retrieve_recv_grads(bwd_chunk_id)
        _release(self.grad_recv_info[bwd_chunk_id])
        return grads


# What parallel/pp_sends.py reads of a lowered schedule's actions: their kind, by torch's names.
PIPELINE_ACTIONS = {schedules.FORWARD: "F", schedules.FULL_BACKWARD: "B", schedules.BACKWARD_INPUT: "B",
                    schedules.SEND_F: "SEND_F", schedules.SEND_B: "SEND_B"}


@contextlib.contextmanager
def capturing_pipeline_posts(posted):
    """While the block runs, `posted(ops, works)` sees every batch of P2P ops torch's
    schedules post and the works they return (the lists the schedule keeps to wait).
    Where torch has no `_batch_p2p` nothing is seen, and the schedule waits its sends
    at the step's end as torch does."""
    original = getattr(schedules, "_batch_p2p", None)
    if original is None:
        yield
        return

    def batch_p2p(ops, *args, **kwargs):
        works = original(ops, *args, **kwargs)
        posted(ops, works)
        return works

    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = original


_NO_BUFFER = {}  # (dtype, device) -> an empty tensor standing in for a receive buffer not allocated


def _release(infos) -> None:
    """Drop the stage's references to receive buffers (an empty stand-in keeps torch's
    `buffer is None` meaning: no tensor to receive)."""
    for info in infos:
        if not info.is_root_arg and info.buffer is not None and info.tensor_meta is not None:
            key = (info.buffer.dtype, info.buffer.device)
            info.buffer = _NO_BUFFER.setdefault(key, torch.empty(0, dtype=key[0], device=key[1]))


def _allocate(infos, device) -> None:
    """A fresh buffer for every receive about to be posted."""
    for info in infos:
        if not info.is_root_arg and info.tensor_meta is not None and info.buffer is not None \
                and info.buffer.numel() == 0:
            meta = info.tensor_meta
            info.buffer = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)
