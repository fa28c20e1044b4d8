"""One rank of a warm pool (autotune/launch/pool.py): torch imported once, one trial after another.

    python -m autotune.runtime.pool_rank --rank R --world-size N

Reads one request per line on stdin, {"spec": TrialSpec JSON, "store": path, "stdout":
path, "stderr": path}; for each it points its stdout and stderr at the trial's files,
forms a new gloo process group over the request's FileStore, runs the trial exactly as
`python -m autotune.runtime.trial` does (trial.run, the same markers), destroys the group,
forgets DTensor's caches of it (torch_compat.forget_process_groups), collects garbage and
writes `AUTOTUNE_DONE` on its stderr. A rank whose trial raised
reports it (trial.report_error) and exits 1: the pool is then replaced, so a failure never
leaves a process in an unknown state for the next trial. End of input: exit 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

from autotune.runtime.torch_compat import forget_process_groups
from autotune.runtime.trial import report_error, run
from autotune.trialspec import DONE_MARKER, RESULT_MARKER, TrialSpec, die_with_parent


def redirect(stdout: str, stderr: str) -> None:
    """This process's file descriptors 1 and 2 onto the trial's log files (C++ output too)."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)


def serve(rank: int, world_size: int, requests) -> int:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for line in requests:
        request = json.loads(line)
        redirect(request["stdout"], request["stderr"])
        spec = TrialSpec.from_json(request["spec"])
        try:
            store = dist.FileStore(request["store"], world_size)
            dist.init_process_group(backend="nccl" if spec.device == "cuda" else "gloo", store=store, rank=rank,
                                    world_size=world_size)
            result = run(spec)
            if rank == 0:
                print(RESULT_MARKER + json.dumps(result), flush=True)
            dist.barrier()
            dist.destroy_process_group()
            forget_process_groups()
        except Exception as exc:  # noqa: BLE001 - reported, then this rank leaves the pool
            report_error(exc)
            return 1
        del store
        gc.collect()
        if spec.device == "cuda":
            torch.cuda.empty_cache()
        print(DONE_MARKER, file=sys.stderr, flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description="one rank of a warm pool of trial processes")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    args = parser.parse_args()
    die_with_parent()
    return serve(args.rank, args.world_size, sys.stdin)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as trial.py: skip the teardown of the profiler's and gloo's C++ threads
