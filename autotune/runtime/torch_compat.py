"""Every private torch API the runtime and its kernels use, in one place.

torch moves its underscored modules between releases; a torch upgrade mends this file
and nothing else. Each entry says what it is for.
"""

from __future__ import annotations

import ctypes
import glob
import os

import torch
from torch.distributed._composable.replicate_with_fsdp import replicate  # noqa: F401 (zero 0/1)
from torch.distributed._functional_collectives import all_to_all_single_autograd  # noqa: F401 (EP's token exchange)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper  # noqa: F401 (recompute)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.pipelining import PipelineStage
from torch.utils._python_dispatch import is_traceable_wrapper_subclass  # noqa: F401 (DTensor owns no storage)

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


# -- pipelining --------------------------------------------------------------------------------

class CleanedPipelineStage(PipelineStage):
    """torch's PipelineStage, calling `after_metadata_inference()` when torch cleans up
    after the real forward and backward by which it infers the stages' tensor shapes on
    the first step (a private step of PipelineStage)."""

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        self.after_metadata_inference()

    def after_metadata_inference(self) -> None:
        """Override: forget what the inference's forward and backward recorded."""
