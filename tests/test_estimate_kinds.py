"""The estimator prices each kind of block by its own parameters, activations and FLOPs."""

import dataclasses

import pytest

from autotune.config import MLAConfig, load_hardware, load_model
from autotune.estimate import estimate
from autotune.estimate.memory import block_saved_tensors, model_figures
from autotune.plan.layout import resolve

H100 = load_hardware("h100-sxm")
LLAMA_8B = load_model("llama3-8b")


def with_(model, **changes):
    return dataclasses.replace(model, **changes).validate()


def test_two_matrix_mlps_hold_two_thirds_of_the_weights_and_two_thirds_of_the_saved_tensors():
    gelu = with_(LLAMA_8B, mlp="gelu")
    assert model_figures(gelu).dense_mlp * 3 == model_figures(LLAMA_8B).dense_mlp * 2
    saved = {m: sum(i.elements for i in block_saved_tensors(with_(LLAMA_8B, mlp=m), False, 2) if "mlp (" in i.name)
             for m in ("swiglu", "geglu", "gelu", "relu2")}
    assert saved == {"swiglu": 3 * 14336, "geglu": 3 * 14336, "gelu": 2 * 14336, "relu2": 2 * 14336}
    layout = resolve("tp=2,dp=4", LLAMA_8B, 8, 8)
    assert estimate(gelu, layout, H100).memory["params"] < estimate(LLAMA_8B, layout, H100).memory["params"]


def test_a_window_cuts_attention_flops_to_the_window():
    windowed = with_(LLAMA_8B, sliding_window=1024)
    attention = 12 * 32 * 32 * 128
    assert LLAMA_8B.flops_per_token() - windowed.flops_per_token() == attention * (8192 - 1024)
    half = with_(LLAMA_8B, sliding_window=1024, sliding_window_layers=list(range(0, 32, 2)))
    assert LLAMA_8B.flops_per_token() - half.flops_per_token() == attention * (8192 - 1024) // 2


def test_mla_prices_its_low_rank_projections_and_head_dims():
    ds = load_model("deepseek-v3")
    m = ds.mla
    h, heads = 7168, 128
    attention = (h * 1536 + 1536 + 1536 * heads * 192 + h * (512 + 64) + 512 + 512 * heads * (128 + 128)
                 + heads * 128 * h)
    assert ds.attention_params() == attention
    assert ds.flops_per_token() == 6 * ds.active_matmul_params() + 61 * 6 * heads * (192 + 128) * ds.seq_len
    saved = {i.name: i.elements for i in block_saved_tensors(ds, True, 2)}
    assert saved["q after rope"] == saved["k after rope"] == heads * 192
    # values (128) padded to the key width (192) for the fused kernel, which keeps its padded
    # output; wo keeps the output cut back to 128 a head (runtime/mla.py)
    assert saved["v padded to the key width"] == saved["attention output, padded"] == heads * 192
    assert saved["attention output (wo's input)"] == heads * 128 and "v" not in saved
    assert saved["kv latent norm input and output"] == 2 * m.kv_lora_rank
    no_q_latent = with_(ds, mla=MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128))
    assert ds.attention_params() - no_q_latent.attention_params() == h * 1536 + 1536 + 1536 * heads * 192 \
        - h * heads * 192


def test_tensor_parallel_leaves_mla_down_projections_whole():
    """runtime/mla.py keeps the down projections and latent norms whole on every tp rank:
    tp=2 halves only the rest of each layer's attention (and the MLP, the vocabulary)."""
    ds = load_model("deepseek-v3")
    whole = 7168 * 1536 + 1536 + 7168 * (512 + 64) + 512
    dense = with_(ds, moe=None, num_layers=2)
    one, two = (estimate(dense, resolve(f"tp={tp},mbs=1", dense, tp, 8), H100).memory["params"] for tp in (1, 2))
    split = dense.num_params() - dense.num_layers * (whole + 2 * 7168) - 7168  # all but the whole ones and norms
    assert one - two == 2 * split / 2  # bf16 parameters: 2 bytes each, half of them gone at tp=2


def test_dense_first_layers_and_shared_experts_are_priced():
    ds = load_model("deepseek-v3")
    fig = model_figures(ds)
    expert = 3 * 7168 * 2048
    assert fig.moe_dense == 7168 * 256 + expert and fig.moe_routed == 256 * expert
    assert ds.num_moe_layers == 58 and fig.dense_mlp == 3 * 7168 * 18432


@pytest.mark.parametrize("layout", ["pp=16,ep=8,dp=16,mbs=1,recompute=full", "pp=8,tp=8,ep=4,dp=4,mbs=1"])
def test_deepseek_v3_prices_layouts_with_expert_parallel(layout):
    ds = load_model("deepseek-v3")
    e = estimate(ds, resolve(layout, ds, 256, 8), H100)
    assert e.peak_mem_bytes > 0 and e.tokens_per_s > 0 and e.memory["params"] > 0


def test_tensor_parallel_time_keeps_mla_down_projections_whole():
    """Every tp rank computes MLA's down projections whole, so tp=2 halves the weight
    gradients' time but for them: 2 * t(tp=2) - t(tp=1) is their time, zero for GQA."""
    from autotune.config.model_size import unsplit_attention_params
    from autotune.estimate.memory import pipeline_shapes
    from autotune.estimate.step_time import Links, microbatch_works
    from autotune.plan.mesh_layout import ParallelDims

    rate = 1e15

    def weight_time(model, tp):
        layout = resolve(f"tp={tp},mbs=1", model, tp, 8)
        groups = ParallelDims.from_layout(layout).groups()
        works = microbatch_works(model, layout, Links(H100, 0.75, 2e-5), rate, 2,
                                 list(pipeline_shapes(model, layout)), groups)
        return works[0].backward_weight

    ds = with_(load_model("deepseek-v3"), moe=None, num_layers=2)
    tokens, whole = ds.seq_len, unsplit_attention_params(ds)
    assert 2 * weight_time(ds, 2) - weight_time(ds, 1) == pytest.approx(ds.num_layers * 2 * tokens * whole / rate)
    gqa = with_(LLAMA_8B, num_layers=2)
    assert 2 * weight_time(gqa, 2) == pytest.approx(weight_time(gqa, 1))
