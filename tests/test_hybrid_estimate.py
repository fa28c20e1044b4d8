"""The estimator on hybrid models (estimate/mamba.py): every published Nemotron-H config priced
under the dimensions the runtime trains, full recompute costing one more forward of every
block (Mamba scans included), tensor parallel one all-reduce pair per single-mixer block."""

import dataclasses
from pathlib import Path

import pytest

from autotune.config import load_hardware, load_model
from autotune.estimate import estimate
from autotune.estimate.calibration import Calibration
from autotune.estimate.mamba import block_core_flops, block_matmul_params
from autotune.plan.layout import resolve

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
H100 = load_hardware("h100-sxm")
NO_LATENCY = dataclasses.replace(Calibration(), latency_s=0.0)


@pytest.mark.parametrize("fixture, gpus, text", [
    ("nemotron-h-8b.json", 8, "tp=2,sp=1,dp=4,zero=1,mbs=1,recompute=full"),
    ("nemotron-h-56b.json", 64, "tp=8,sp=1,pp=4,dp=2,zero=1,schedule=1f1b,mbs=1"),
    ("nemotron-3-nano-30b-a3b.json", 16, "ep=8,dp=16,zero=1,mbs=1,recompute=full"),
    ("nvidia-nemotron-nano-9b-v2.json", 8, "dp=8,zero=3,mbs=1,recompute=selective"),
])
def test_published_hybrids_are_priced(fixture, gpus, text):
    model = load_model(str(FIXTURES / fixture))
    e = estimate(model, resolve(text, model, gpus, 8), H100, calibration=NO_LATENCY)
    assert 0 < e.peak_mem_bytes < 80 * 2**30 and e.step_time_s > 0 and 0 < e.mfu < 1


def test_full_recompute_costs_one_more_forward_of_every_block():
    model = load_model(str(FIXTURES / "nemotron-h-8b.json"))
    none, full = (estimate(model, resolve(f"dp=8,mbs=1,recompute={r}", model, 8, 8), H100, calibration=NO_LATENCY)
                  for r in ("none", "full"))
    forward = sum(2 * block_matmul_params(model, kind) + block_core_flops(model, kind) / 3
                  for kind in (("mamba", "attention", "mlp")[["M", "*", "-"].index(c)] for c in model.hybrid_pattern))
    flops_per_s = H100.peak_tflops * 1e12 * NO_LATENCY.compute_efficiency
    assert full.compute_s - none.compute_s == pytest.approx(model.seq_len * forward * none.grad_accum / flops_per_s,
                                                            rel=1e-6)


def test_tensor_parallel_cuts_each_block_once():
    """The same stream width and block count: a hybrid block gathers and scatters once, a dense
    decoder layer twice."""
    hybrid = load_model(str(FIXTURES / "nemotron-h-8b.json"))
    dense = dataclasses.replace(hybrid, hybrid_pattern=None, mamba=None).validate()
    comm = [estimate(m, resolve("tp=4,sp=1,dp=2,mbs=1", m, 8, 8), H100, calibration=NO_LATENCY).comm_s["tp"]
            for m in (hybrid, dense)]
    assert comm[0] == pytest.approx(comm[1] / 2, rel=0.05)  # within the embedding's and head's share
