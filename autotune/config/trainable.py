"""What the runtime trains, and a one-line refusal for what it does not.

The estimator prices every model the vocabulary describes (model_size.py), but a
trial must train exactly that model or not start: a layout measured on a different
model answers a different question. So `autotune trial` and `run` refuse such a
model with exit 2 before anything is launched.

Trained: GQA attention with or without QK-norm, MLA, sliding windows, every MLP kind
(dense, routed and shared experts), MoE with dense layers between, RMSNorm, RoPE, an
untied head, under every parallel dimension; hybrid Mamba-2 models (runtime/hybrid.py) under
every dimension but context parallel (a layout rule refuses cp > 1 there). Not yet: biases, LayerNorm, learned
positions, tied embeddings, MLA values wider than its queries (the runtime pads values
to the query width: runtime/mla.py).
"""

from __future__ import annotations

from autotune.config import ModelConfig
from autotune.errors import UsageError


def model_refusal(model: ModelConfig) -> str | None:
    """Why the runtime cannot train this model under any layout, or None."""
    if model.attention == "mla" and model.mla.v_head_dim > model.head_dim:  # head_dim: nope + rope under MLA
        return (f"{model.name}: mla.v_head_dim ({model.mla.v_head_dim}) wider than the query head "
                f"({model.head_dim}) is priced by the estimator but not trained by the runtime yet")
    if model.bias != "none":
        return f"{model.name}: bias: {model.bias} is priced by the estimator but not trained by the runtime yet"
    if model.norm != "rmsnorm":
        return f"{model.name}: norm: {model.norm} is priced by the estimator but not trained by the runtime yet"
    if model.learned_positions:
        return f"{model.name}: learned_positions is priced by the estimator but not trained by the runtime yet"
    if model.tie_embeddings:
        return f"{model.name}: tie_embeddings is priced by the estimator but not trained by the runtime yet"
    return None


def precision_refusal(trained: ModelConfig, pp: int = 1) -> str | None:
    """Why the runtime cannot train this model, in the precision it trains in, with pp
    pipeline stages, or None.

    fp16 needs a loss scaler: the runtime scales the language-model loss, but not the MoE
    balance loss, and torch's pipeline schedules call backward themselves, so the scaler
    cannot reach them."""
    if trained.dtype != "fp16":
        return None
    if trained.moe is not None:
        return f"{trained.name}: --dtype fp16 with MoE is not trained (the balance loss is not loss-scaled); use bf16"
    if pp > 1:
        return (f"layout: fp16 under pipeline parallel (pp={pp}) is not trained (torch's pipeline "
                f"schedules run backward outside the loss scaler); use bf16 or pp=1")
    return None


def check_trainable(model: ModelConfig, pp: int = 1) -> None:
    """Raise the one-line refusal for a model (as trained) the runtime cannot train with pp stages."""
    problem = model_refusal(model) or precision_refusal(model, pp)
    if problem:
        raise UsageError(problem)
