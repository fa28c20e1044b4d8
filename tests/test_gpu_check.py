"""benchmarks/gpu_check.py, the parts that run without a GPU or a trial: the kernel
census of a trace and the refusal to run without CUDA unless asked for a dry run.
(The dry run itself, every trial on the CPU, takes minutes: benchmarks/README.md.)"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_census_counts_gpu_kernels_or_cpu_operators(gpu_check, tmp_path):
    events = [{"cat": "kernel", "name": "sm90_xmma_gemm"}, {"cat": "kernel", "name": "sm90_xmma_gemm"},
              {"cat": "kernel", "name": "ncclDevKernel_AllReduce"}, {"cat": "cpu_op", "name": "aten::mm"}]
    (tmp_path / "rank0.json").write_text(json.dumps({"traceEvents": events}))
    assert gpu_check.kernel_names(tmp_path, "cuda") == {"sm90_xmma_gemm": 2, "ncclDevKernel_AllReduce": 1}
    assert gpu_check.kernel_names(tmp_path, "cpu") == {"aten::mm": 1}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_refuses_in_one_line_unless_a_dry_run(gpu_check, capsys):
    assert gpu_check.main([]) == 2
    assert "--dry-run" in capsys.readouterr().err
