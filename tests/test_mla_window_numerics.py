"""Multi-head latent attention and sliding windows against one process (fp32 CPU, tiny
models): the same losses and trained parameters under TP(+SP), FSDP, PP (1F1B and ZB-V),
CP, EP and full recompute.

    mla moe         DeepSeek-style: MLA with query compression, a shared expert and a
                    dense first layer, under EP too
    mla, no q_lora  the query without its latent (wq), values narrower than keys
    gelu window     a window of 6 tokens on every layer (narrower than CP's chunks)
    relu2 window    a window of 12 tokens on layers 0 and 2 (Gemma's interleaving; wider
                    than a chunk, so the ring masks some chunk pairs and skips others)
"""

import dataclasses

import pytest

from autotune.config import MLAConfig, MoEConfig, load_model
from autotune.plan.layout import resolve
from support.numerics import assert_same_training
from support.spawn_group import run_layouts

TINY = dataclasses.replace(load_model("tiny"), num_layers=4, global_batch_size=8, seq_len=32)
MLA = dict(attention="mla", num_kv_heads=TINY.num_heads, head_dim=None)
MLA_MOE = dataclasses.replace(
    TINY, name="tiny-mla-moe", **MLA,
    mla=MLAConfig(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
    moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_size=32, num_shared_experts=1, layers=[1, 2, 3])
).validate()
MLA_PLAIN_QUERY = dataclasses.replace(
    TINY, name="tiny-mla", **MLA,
    mla=MLAConfig(q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=4)
).validate()
GELU_WINDOW = dataclasses.replace(TINY, name="tiny-gelu-window", mlp="gelu", sliding_window=6).validate()
RELU2_WINDOW = dataclasses.replace(TINY, name="tiny-relu2-window", mlp="relu2", sliding_window=12,
                                   sliding_window_layers=[0, 2]).validate()

DENSE_LAYOUTS = ["tp=2,sp=1,mbs=8", "zero=3,mbs=4", "pp=2,schedule=1f1b,mbs=2", "pp=2,schedule=zbv,mbs=2",
                 "cp=2,mbs=8", "recompute=full,zero=2,mbs=4"]


def full(text: str, model, gpus: int) -> str:
    return str(resolve(text, model, gpus))


def one_process(model) -> dict:
    return run_layouts(1, [full("mbs=8", model, 1)], model=model, with_params=True)[0]


def trains_as_one_process(model, layouts: list[str], gpus: int = 2) -> None:
    assert_same_training(one_process(model), run_layouts(gpus, [full(t, model, gpus) for t in layouts],
                                                         model=model, with_params=True))


@pytest.mark.parametrize("model", [GELU_WINDOW, RELU2_WINDOW], ids=lambda m: m.name)
def test_sliding_windows_train_as_one_process(model):
    trains_as_one_process(model, DENSE_LAYOUTS)


def test_windows_under_four_way_context_parallel_train_as_one_process():
    """cp=4: chunks of 4 tokens, so the 6- and 12-token windows reach across chunks."""
    trains_as_one_process(RELU2_WINDOW, ["cp=4,mbs=8", "cp=2,tp=2,sp=1,mbs=8"], gpus=4)


def test_mla_moe_with_a_shared_expert_and_a_dense_first_layer_trains_as_one_process():
    trains_as_one_process(MLA_MOE, DENSE_LAYOUTS + ["ep=2,mbs=4", "ep=2,zero=3,recompute=full,mbs=4"])


def test_mla_without_query_compression_trains_as_one_process():
    trains_as_one_process(MLA_PLAIN_QUERY, ["tp=2,mbs=8", "tp=2,sp=1,recompute=selective,mbs=8", "cp=2,zero=1,mbs=4",
                                            "tp=2,sp=1,recompute=op,mbs=8"])
