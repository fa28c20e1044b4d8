"""Run in a child process: parse torchtitan command lines with torchtitan 0.3.0's own
ConfigManager, then apply the checks its trainer makes before it builds anything
(ParallelDims, the batch arithmetic, the pipeline's stages per rank).

Reads a JSON list of {"args": [...], "world": N, "stages_per_rank": S} on stdin and
prints one JSON result per line. torchtitan's config functions import its MoE module,
which imports Triton GPU kernels at import time; on a machine without Triton (the CPU
build of torch) that one kernel module is replaced by functions that refuse to run,
since parsing a config never calls them. A config function that converts its Linears to
float8 (llama3_405b) asks for an SM89 GPU while the config is built; the exports target
one, so on a machine without it that question is answered yes.
"""

import importlib.util
import json
import sys
import types

KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
KERNEL_NAMES = ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
                "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
                "reduce_topk_slots_kernel", "topk_scores_grad_kernel")


def without_triton() -> None:
    def unavailable(*args, **kwargs):
        raise RuntimeError("needs Triton")

    stand_in = types.ModuleType(KERNELS)
    for name in KERNEL_NAMES:
        setattr(stand_in, name, unavailable)
    sys.modules[KERNELS] = stand_in


def as_on_a_float8_gpu() -> None:
    import torchtitan.components.quantization.float8 as float8

    float8.has_cuda_capability = lambda major, minor: True


def check(case: dict) -> dict:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims

    config = ConfigManager().parse_args(case["args"])
    par, training = config.parallelism, config.training
    dims = ParallelDims.from_config(par, case["world"])
    batch = dims.dp_replicate * dims.dp_shard
    assert training.global_batch_size % (training.local_batch_size * batch) == 0, "global % (local * dp)"
    accumulation = training.global_batch_size // (training.local_batch_size * batch)
    microbatches = 1
    if dims.pp > 1:
        assert training.local_batch_size % par.pipeline_parallel_microbatch_size == 0
        microbatches = training.local_batch_size // par.pipeline_parallel_microbatch_size
        parts = par.module_fqns_per_model_part
        assert len(parts) % dims.pp == 0, "stages must divide by pp"
        single = issubclass(get_schedule_class(par.pipeline_parallel_schedule), PipelineScheduleSingle)
        per_rank = len(parts) // dims.pp
        assert (per_rank == 1) if single else (per_rank >= 2), f"{per_rank} stages per rank"
        assert per_rank == case["stages_per_rank"]
    return {"dims": [dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp, dims.ep],
            "accumulation": accumulation, "microbatches": microbatches,
            "ac": type(config.activation_checkpoint).__qualname__, "sp": par.enable_sequence_parallel,
            "parts": par.module_fqns_per_model_part,
            "compile": [config.compile.enable, list(config.compile.components)],
            "async_tp": config.compile.enable_async_tensor_parallel}


if __name__ == "__main__":
    if importlib.util.find_spec("triton") is None:
        without_triton()
    as_on_a_float8_gpu()
    for case in json.load(sys.stdin):
        print(json.dumps(check(case)), flush=True)
