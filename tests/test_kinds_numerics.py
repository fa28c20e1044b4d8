"""Each MLP kind and QK-norm against one process (fp32 CPU, tiny models): the same losses
and trained parameters under TP(+SP), FSDP, PP, CP, EP and full recompute.

    gelu + qk_norm        a dense GPT-style model whose attention normalises q and k
    relu2                 a dense squared-ReLU model
    geglu MoE             a shared expert and a dense first layer, under EP too
"""

import dataclasses

import pytest

from autotune.config import MoEConfig, load_model
from autotune.plan.layout import resolve
from support.numerics import assert_same_training
from support.spawn_group import run_layouts

TINY = dataclasses.replace(load_model("tiny"), num_layers=4, global_batch_size=8, seq_len=32)
GELU = dataclasses.replace(TINY, name="tiny-gelu", mlp="gelu", qk_norm=True).validate()
RELU2 = dataclasses.replace(TINY, name="tiny-relu2", mlp="relu2").validate()
GEGLU_MOE = dataclasses.replace(
    TINY, name="tiny-geglu-moe", mlp="geglu",
    moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_size=32, num_shared_experts=1, layers=[1, 2, 3])
).validate()

# tp=2 without SP at two micro-batches: QK-norm's weight gradients, partial sums over tp,
# summed over the micro-batches before their one all-reduce (parallel/ddp.py).
DENSE_LAYOUTS = ["tp=2,sp=1,mbs=8", "tp=2,mbs=4", "zero=3,mbs=4", "pp=2,schedule=1f1b,mbs=2", "cp=2,mbs=8",
                 "recompute=full,zero=2,mbs=4"]


def full(text: str, model, gpus: int) -> str:
    return str(resolve(text, model, gpus))


def one_process(model) -> dict:
    return run_layouts(1, [full("mbs=8", model, 1)], model=model, with_params=True)[0]


@pytest.mark.parametrize("model", [GELU, RELU2], ids=lambda m: m.name)
def test_dense_kinds_train_as_one_process(model):
    assert_same_training(one_process(model), run_layouts(2, [full(t, model, 2) for t in DENSE_LAYOUTS],
                                                         model=model, with_params=True))


def test_geglu_moe_with_a_shared_expert_and_a_dense_first_layer_trains_as_one_process():
    model = GEGLU_MOE
    layouts = ["ep=2,mbs=4", "ep=2,zero=3,recompute=full,mbs=4", "tp=2,sp=1,mbs=8", "pp=2,schedule=1f1b,mbs=2"]
    assert_same_training(one_process(model), run_layouts(2, [full(t, model, 2) for t in layouts],
                                                         model=model, with_params=True))
