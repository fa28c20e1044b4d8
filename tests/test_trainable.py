"""What the runtime does not train yet is refused in one line before anything starts."""

import dataclasses

import pytest

from autotune.cli import main
from autotune.config import load_model, model_from_dict
from autotune.errors import UsageError
from autotune.trainable import check_trainable, model_refusal

TINY = load_model("tiny")


@pytest.mark.parametrize("changes, field", [
    ({"attention": "mla", "head_dim": None, "num_kv_heads": 8, "mla": {"kv_lora_rank": 16, "qk_nope_head_dim": 8,
                                                    "qk_rope_head_dim": 8, "v_head_dim": 8}}, "attention: mla"),
    ({"sliding_window": 16}, "sliding_window"), ({"bias": "qkv"}, "bias: qkv"),
    ({"norm": "layernorm"}, "norm: layernorm"),
    ({"learned_positions": 64}, "learned_positions"), ({"tie_embeddings": True}, "tie_embeddings"),
])
def test_untrained_kinds_are_refused_by_field(changes, field):
    model = model_from_dict({**dataclasses.asdict(TINY), **changes})
    with pytest.raises(UsageError, match=f"^tiny: {field} is priced by the estimator but not trained"):
        check_trainable(model)


def test_trained_kinds_pass():
    for mlp in ("swiglu", "geglu", "gelu", "relu2"):
        assert model_refusal(dataclasses.replace(TINY, mlp=mlp, qk_norm=True)) is None
    assert model_refusal(load_model("qwen3-30b-a3b")) is None


def test_trial_and_run_refuse_before_launching(capsys):
    for argv in (["trial", "--model", "deepseek-v3", "--gpus", "1", "--layout", "mbs=1"],
                 ["run", "--model", "deepseek-v3", "--gpus", "1"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "attention: mla is priced by the estimator but not trained" in err[0]
