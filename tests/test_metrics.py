"""A trial's metrics (docs/metrics.md): FLOPs per token by hand, MFU and the summaries
from the measured numbers, the peak's sources, and the memory budget through the CLI."""

import dataclasses
import json
import re
import statistics
import subprocess
import sys

import pytest
import torch

from autotune.config import load_model
from autotune.plan.layout import resolve
from autotune.runtime.peak_flops import gemm_flops, peak_flops
from autotune.runtime.trial import GIB, is_out_of_memory, measurements, memory_budget
from autotune.trialspec import TrialSpec
from support.spawn_group import run_layouts

TINY = load_model("tiny")


def test_flops_per_token_of_llama3_8b_and_mixtral_by_hand():
    # Llama 3 8B: per layer q,o 4096x4096, k,v 4096x1024 (8 kv heads of 128), SwiGLU 3 x 4096x14336;
    # output head 128256x4096; attention term 12 * 32 layers * 32 heads * 128 * 8192 tokens.
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024  # 41,943,040
    llama_layer = attention + 3 * 4096 * 14336  # 218,103,808
    llama_active = 32 * llama_layer + 128256 * 4096  # 7,504,658,432
    assert llama_active == 7_504_658_432
    assert load_model("llama3-8b").flops_per_token() == 6 * llama_active + 12 * 32 * 32 * 128 * 8192 \
        == 57_912_852_480
    # Mixtral 8x7B: the same attention; per layer a router 4096x8 and 2 active of 8 experts,
    # each a SwiGLU 3 x 4096x14336; head 32000x4096; 4096 tokens.
    mixtral_layer = attention + 4096 * 8 + 2 * 3 * 4096 * 14336  # 394,297,344
    mixtral_active = 32 * mixtral_layer + 32000 * 4096  # 12,748,587,008
    assert mixtral_active == 12_748_587_008
    assert load_model("mixtral-8x7b").flops_per_token() == 6 * mixtral_active + 12 * 32 * 32 * 128 * 4096 \
        == 82_933_972_992


def test_peak_flops_sources_in_order():
    cpu = torch.device("cpu")
    assert peak_flops(2.5, "h100-sxm", cpu, torch.float32) == (2.5e12, "--peak-tflops")
    assert peak_flops(None, "h100-sxm", cpu, torch.float32) == (989e12, "hardware preset h100-sxm")
    flops, source = peak_flops(None, "cpu", cpu, torch.float32)  # the cpu preset says: calibrate
    assert re.match(r"calibration: \d+x\d+ float32 GEMM", source) and 1e8 < flops < 1e13  # its size: the next test


def test_calibration_grows_its_gemm_only_while_the_next_size_fits_the_time_budget(monkeypatch):
    """8x the FLOPs a doubling: a size grows while 8 x its GEMM's time is within the budget."""
    from autotune.runtime import peak_flops as module

    cpu = torch.device("cpu")
    for per_gemm_at_256, expected in ((1e-4, 1024), (0.02, 512), (0.2, 256)):
        monkeypatch.setattr(module, "gemm_seconds", lambda device, dtype, n, t=per_gemm_at_256: t * (n / 256) ** 3)
        assert module.calibration_size(cpu, torch.bfloat16) == expected, per_gemm_at_256
    monkeypatch.setattr(module, "gemm_seconds", lambda device, dtype, n: 0.0)
    assert module.calibration_size(cpu, torch.float32) == module.CALIBRATION_SIZE["cpu"]  # never past the cap


def test_calibration_measures_a_gemm_rate_that_agrees_with_timing_it():
    import time
    n = 256
    rate = gemm_flops(torch.device("cpu"), torch.float32, n, repeats=5)
    a = torch.randn(n, n)
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    average = 20 * 2 * n**3 / (time.perf_counter() - start)
    assert 0.5 * average <= rate <= 20 * average  # the best of five: at least half an average run's rate


def test_memory_budget_sources():
    spec = TrialSpec(model=dataclasses.asdict(TINY), layout="")
    assert memory_budget(spec, torch.device("cpu")) is None
    assert memory_budget(dataclasses.replace(spec, memory_budget_gb=0.5), torch.device("cpu")) == GIB // 2
    assert memory_budget(dataclasses.replace(spec, hardware="a100-80gb"), torch.device("cpu")) == 80 * GIB
    both = dataclasses.replace(spec, hardware="a100-80gb", memory_budget_gb=2.0)
    assert memory_budget(both, torch.device("cpu")) == 2 * GIB


def test_out_of_memory_errors_are_recognised():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    with pytest.raises(RuntimeError) as caught:
        torch.empty(1 << 60, dtype=torch.uint8)  # more than any machine has: the CPU allocator refuses
    assert is_out_of_memory(caught.value)
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_trial_figures_follow_their_formulas():
    layout = str(resolve("mbs=2", TINY, 2))
    r = run_layouts(2, [layout], steps=3, warmup=1, profile=True)[0]
    assert r["status"] == "complete" and r["world_size"] == 2
    per_rank = r["step_times_s_per_rank"]
    assert len(per_rank) == 2 and all(len(steps) == 3 for steps in per_rank)
    assert r["step_times_s"] == [max(a, b) for a, b in zip(*per_rank)]
    assert r["step_time_s"] == statistics.median(r["step_times_s"])
    tokens = TINY.global_batch_size * TINY.seq_len
    assert r["tokens_per_s"] == pytest.approx(tokens / r["step_time_s"], rel=1e-12)
    assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2, rel=1e-12)
    assert r["flops_per_token"] == TINY.flops_per_token()
    # calibrated on every rank; MFU divides by the ranks' summed peak
    assert r["peak_tflops_source"].startswith("calibration")
    assert r["peak_tflops"] == pytest.approx(statistics.fmean(r["peak_tflops_per_rank"]), rel=1e-12)
    assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / (2 * r["peak_tflops"] * 1e12),
                                     rel=1e-12)
    assert 0 < r["mfu"] < 1
    for name in ("comm_fraction", "exposed_comm_fraction"):
        values = r[f"{name}_per_rank"]
        assert r[name] == max(values) and r[f"{name}_mean"] == pytest.approx(statistics.fmean(values))
    # data parallel all-reduces gradients, and on the CPU nothing overlaps it
    assert 0 < r["exposed_comm_fraction"] <= r["comm_fraction"] < 1
    assert r["peak_mem_bytes"] == max(r["peak_mem_bytes_per_rank"])
    # between steps each rank holds the weights, the gradient buffer and AdamW's two
    # moments (fp32: 4 copies); a step adds activations, at least every layer's input
    state = 4 * 4 * TINY.num_params()
    layer_inputs = TINY.num_layers * TINY.seq_len * TINY.hidden_size * 4
    for resident, peak in zip(r["resident_mem_bytes_per_rank"], r["peak_mem_bytes_per_rank"]):
        assert state <= resident <= 1.01 * state
        assert peak > resident + layer_inputs
    assert r["memory_budget_bytes"] is None
    # what a caching allocator reserves beyond the live peak: CUDA's figure; the CPU's caches nothing
    assert r["reserved_mem_bytes"] is None and r["reserved_mem_bytes_per_rank"] == [None, None]


def test_the_reserved_figure_is_the_largest_ranks():
    """On CUDA each rank reports the allocator's reserved peak; the trial's is the largest."""
    rank = dict(step_times_s=[0.1], peak_mem_bytes=10, resident_mem_bytes=5, step_peak_mem_bytes=[10],
                memory_source="allocator statistics", comm_fraction=0.0, exposed_comm_fraction=0.0,
                peak_flops=1e12, trace_file=None)
    figures = measurements(TINY, 2, [dict(rank, reserved_mem_bytes=14), dict(rank, reserved_mem_bytes=12)], "given")
    assert figures["reserved_mem_bytes"] == 14 and figures["reserved_mem_bytes_per_rank"] == [14, 12]


def test_cli_trial_over_a_tiny_memory_budget_is_pruned_oom_with_its_figures(tmp_path):
    out = subprocess.run([sys.executable, "-m", "autotune", "trial", "--model", "tiny", "--gpus", "2",
                          "--steps", "2", "--warmup", "1", "--memory-budget-gb", "0.001", "--peak-tflops", "0.5",
                          "--trace", str(tmp_path / "trace"), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr  # not complete
    r = json.loads(out.stdout)
    assert (r["status"], r["reason"]) == ("pruned", "oom"), r
    assert r["memory_budget_bytes"] == int(0.001 * GIB)
    assert r["peak_mem_bytes"] > r["memory_budget_bytes"] and r["peak_mem_bytes"] == max(r["peak_mem_bytes_per_rank"])
    assert "over the memory budget" in r["error"]
    assert (r["peak_tflops"], r["peak_tflops_source"]) == (0.5, "--peak-tflops")
    assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / (2 * 0.5e12), rel=1e-12)
    # each rank's trace: Chrome/Perfetto JSON holding the measured steps and gloo's collectives
    assert sorted(r["trace_files"]) == [str(tmp_path / "trace" / f"rank{i}.json") for i in range(2)]
    for path in r["trace_files"]:
        names = {e.get("name") for e in json.loads(open(path).read())["traceEvents"]}
        assert "autotune.step" in names and "gloo:all_reduce" in names


def test_cli_rejects_a_bad_peak_and_an_unknown_hardware():
    for args, field in ((["--peak-tflops", "0"], "--peak-tflops"), (["--hardware", "tpu9"], "hardware")):
        out = subprocess.run([sys.executable, "-m", "autotune", "trial", "--model", "tiny", "--gpus", "2", *args],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and field in out.stderr and len(out.stderr.strip().splitlines()) == 1, out


def test_cli_trial_whose_allocation_fails_is_pruned_oom(tmp_path):
    # A 4 TiB embedding: the CPU allocator refuses it when the weights are materialised.
    model = tmp_path / "huge.yaml"
    model.write_text("vocab_size: 16777216\nhidden_size: 65536\nnum_layers: 1\nnum_heads: 64\n"
                     "ffn_hidden_size: 128\nseq_len: 8\nglobal_batch_size: 2\ndtype: fp32\n")
    out = subprocess.run([sys.executable, "-m", "autotune", "trial", "--model", str(model), "--gpus", "1",
                          "--json"], capture_output=True, text=True, timeout=120)
    r = json.loads(out.stdout)
    assert (out.returncode, r["status"], r["reason"]) == (1, "pruned", "oom"), r
    assert "can't allocate memory" in r["error"]
