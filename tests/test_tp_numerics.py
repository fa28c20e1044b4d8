"""Tensor parallel (with and without sequence parallel, alone and with data parallel),
GQA head splits and activation recompute against one process: same losses at every
step and same trained parameters."""

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from autotune.config import load_model
from autotune.plan.layout import resolve
from support.numerics import assert_same_training
from support.spawn_group import run_layouts
from support.step_probe import local_attention_shapes

TINY = load_model("tiny")  # 8 heads, 4 kv heads (GQA), head_dim 8, global batch 16


def full(text: str, gpus: int) -> str:
    return str(resolve(text, TINY, gpus))


@pytest.fixture(scope="module")
def reference():
    return run_layouts(1, [full("", 1), full("recompute=selective,mbs=4", 1), full("recompute=op,mbs=4", 1),
                           full("recompute=full,mbs=4", 1), full("recompute=full,recompute_layers=3,mbs=2", 1)],
                       with_params=True)



def test_recompute_selective_and_full_match_none_on_one_process(reference):
    none, *recomputed = reference
    assert_same_training(none, recomputed)


def test_tp2_with_and_without_sp_and_recompute(reference):
    # mbs > 1 only to keep the suite fast: every layout trains the same global batch.
    layouts = [full(text, 2) for text in ("tp=2,mbs=4", "tp=2,sp=1,mbs=4", "tp=2,sp=1,recompute=selective,mbs=8",
                                          "tp=2,recompute=full,mbs=8")]
    assert_same_training(reference[0], run_layouts(2, layouts, with_params=True))


def test_tp4_with_and_without_sp_and_dp2_x_tp2(reference):
    """tp=4 leaves one of tiny's 4 kv heads (and 2 of its 8 query heads) on each rank."""
    layouts = [full(text, 4) for text in (
        "tp=4,mbs=8", "tp=4,sp=1,mbs=16", "dp=2,tp=2,zero=0,mbs=8",
        "dp=2,tp=2,zero=1,sp=1,recompute=op,mbs=8", "dp=2,tp=2,zero=3,sp=1,recompute=full,mbs=4")]
    assert_same_training(reference[0], run_layouts(4, layouts, with_params=True))


def test_gqa_kv_heads_split_with_their_query_heads():
    """Each rank holds heads/tp query heads and kv_heads/tp kv heads, 8 values wide.

    Shapes need no communication, so each rank is played in this process on a fake
    process group (torch's testing backend) instead of spawning four."""
    for rank in range(4):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        try:
            tp2, tp4 = local_attention_shapes([full("tp=2", 4), full("tp=4,sp=1", 4)])
        finally:
            dist.destroy_process_group()
        assert tp2 == {"wq": [32, 64], "wk": [16, 64], "wv": [16, 64], "wo": [64, 32]}
        assert tp4 == {"wq": [16, 64], "wk": [8, 64], "wv": [8, 64], "wo": [64, 16]}
