"""A hybrid model's peak memory, measured per rank on the CPU, against the estimator's price
(estimate/mamba.py): the Mamba blocks' saved tensors, their scan's backward working set, and
the single-mixer blocks' parameters, under recompute, TP with SP, PP and FSDP."""

import pytest

from autotune.config import load_hardware, model_from_dict
from autotune.estimate import estimate
from autotune.plan.layout import resolve
from support.spawn_group import run_layouts

HYBRID = model_from_dict({
    "name": "tiny-hybrid-memory", "vocab_size": 256, "hidden_size": 64, "num_layers": 6, "num_heads": 4,
    "num_kv_heads": 2, "ffn_hidden_size": 128, "seq_len": 64, "global_batch_size": 8, "dtype": "fp32",
    "mlp": "relu2", "hybrid_pattern": "M*M-EM",
    "mamba": {"state_size": 16, "num_heads": 8, "head_dim": 16, "n_groups": 2, "conv_kernel": 4, "chunk_size": 16},
    "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 32, "num_shared_experts": 1}})


def priced(text: str, gpus: int) -> float:
    return estimate(HYBRID, resolve(text, HYBRID, gpus), load_hardware("cpu"), device="cpu").peak_mem_bytes


@pytest.mark.parametrize("gpus, texts", [
    (1, ["mbs=4", "mbs=4,recompute=full", "mbs=2,recompute=selective"]),
    (2, ["tp=2,sp=1,mbs=4", "pp=2,schedule=1f1b,mbs=2", "zero=3,mbs=2", "ep=2,mbs=2"]),
])
def test_the_trial_peak_is_priced_within_two_percent(gpus, texts):
    layouts = [str(resolve(text, HYBRID, gpus)) for text in texts]
    results = run_layouts(gpus, layouts, model=HYBRID, steps=3, warmup=1, profile=True)
    for text, result in zip(texts, results):
        assert result["peak_mem_bytes"] == pytest.approx(priced(text, gpus), rel=0.02), text
