"""A hybrid Mamba-2 / attention / MLP / MoE model against one process (fp32 CPU, a tiny model):
the same losses and trained parameters under TP with SP (Mamba heads and groups split),
TP alone, FSDP, PP (stages cut between single blocks), EP for the E blocks, and recompute
(full, per-op, selective). Context parallel is refused for Mamba blocks in one line."""

import dataclasses
import re

import pytest

from autotune.config import model_from_dict
from autotune.errors import UsageError
from autotune.plan.layout import resolve
from support.numerics import assert_same_training
from support.spawn_group import run_layouts

HYBRID = model_from_dict({
    "name": "tiny-hybrid", "vocab_size": 128, "hidden_size": 32, "num_layers": 5, "num_heads": 4,
    "num_kv_heads": 2, "ffn_hidden_size": 64, "seq_len": 16, "global_batch_size": 8, "dtype": "fp32",
    "mlp": "relu2", "hybrid_pattern": "ME*M-",
    "mamba": {"state_size": 8, "num_heads": 4, "head_dim": 6, "n_groups": 2, "conv_kernel": 4, "chunk_size": 4},
    "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 16, "num_shared_experts": 1}})

LAYOUTS = ["tp=2,sp=1,mbs=8", "tp=2,mbs=4", "zero=3,mbs=4", "pp=2,schedule=1f1b,mbs=2", "ep=2,mbs=4",
           "recompute=full,zero=2,mbs=4", "recompute=op,tp=2,sp=1,mbs=8", "recompute=selective,ep=2,mbs=4"]


def full(text: str, gpus: int) -> str:
    return str(resolve(text, HYBRID, gpus))


def test_a_hybrid_model_trains_as_one_process_under_every_dimension():
    one = run_layouts(1, [full("mbs=8", 1)], model=HYBRID, with_params=True)[0]
    assert_same_training(one, run_layouts(2, [full(t, 2) for t in LAYOUTS], model=HYBRID, with_params=True))


@pytest.mark.parametrize("layout, message", [
    ("cp=2", "layout.cp: context parallel is not built for Mamba-2 blocks (use cp=1)"),
    ("tp=4", "layout.tp: mamba.n_groups (2) must divide by tp (4)"),
])
def test_what_the_hybrid_runtime_cannot_split_is_refused(layout, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        resolve(layout, dataclasses.replace(HYBRID, num_kv_heads=4), 4 if layout == "tp=4" else 2)
