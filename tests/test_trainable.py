"""What the runtime does not train yet is refused in one line before anything starts; `autotune models`."""

import dataclasses
import json

import pytest

from autotune.cli import main
from autotune.config import PRESET_DIR, as_trained, load_model, model_from_dict
from autotune.config.trainable import check_trainable, model_refusal, precision_refusal
from autotune.errors import UsageError
from autotune.plan.layout import resolve

TINY = load_model("tiny")


@pytest.mark.parametrize("changes, field", [
    ({"attention": "mla", "head_dim": None, "num_kv_heads": 8, "mla": {"kv_lora_rank": 16, "qk_nope_head_dim": 8,
                                                    "qk_rope_head_dim": 8, "v_head_dim": 24}},
     r"mla.v_head_dim \(24\) wider than the query head \(16\)"),
    ({"bias": "qkv"}, "bias: qkv"),
    ({"norm": "layernorm"}, "norm: layernorm"),
    ({"learned_positions": 64}, "learned_positions"), ({"tie_embeddings": True}, "tie_embeddings"),
])
def test_untrained_kinds_are_refused_by_field(changes, field):
    model = model_from_dict({**dataclasses.asdict(TINY), **changes})
    with pytest.raises(UsageError, match=f"^tiny: {field} is priced by the estimator but not trained"):
        check_trainable(model)


def test_trained_kinds_pass():
    for mlp in ("swiglu", "geglu", "gelu", "relu2"):
        assert model_refusal(dataclasses.replace(TINY, mlp=mlp, qk_norm=True, sliding_window=16)) is None
    for preset in ("qwen3-30b-a3b", "deepseek-v3"):
        assert model_refusal(load_model(preset)) is None


def test_trial_and_run_refuse_before_launching(capsys, tmp_path):
    path = tmp_path / "tiny-bias.yaml"
    path.write_text((PRESET_DIR / "tiny.yaml").read_text().replace("name: tiny", "name: tiny-bias") + "bias: qkv\n")
    for argv in (["trial", "--model", str(path), "--gpus", "1", "--layout", "mbs=1"],
                 ["run", "--model", str(path), "--gpus", "1"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "bias: qkv is priced by the estimator but not trained" in err[0]


def test_models_describes_files_and_presets_without_cutting_names(capsys, tmp_path):
    name = "a-model-name-long-enough-to-be-cut-in-a-narrow-terminal"
    long_name = tmp_path / f"{name}.yaml"
    long_name.write_text((PRESET_DIR / "tiny.yaml").read_text().replace("name: tiny", f"name: {name}"))
    assert main(["models", str(long_name), "deepseek-v3"]) == 0
    out = capsys.readouterr().out
    assert name in out and "671.03B" in out
    assert main(["models", "--json", "deepseek-v3"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["attention"], row["mlp"], row["layers"], row["dtype"]) == ("mla", "swiglu", 61, "bf16")
    assert row["params"] == 671026404352 and row["active_params"] == 37552282624


def test_fp16_where_the_loss_scaler_cannot_reach_is_refused_before_launching(capsys):
    """fp16 under PP, and fp16 with MoE, exit 2 with one line instead of failing inside the ranks."""
    for argv, words in ((["trial", "--model", "tiny", "--gpus", "2", "--layout", "pp=2", "--dtype", "fp16"],
                         "fp16 under pipeline parallel (pp=2)"),
                        (["trial", "--model", "tiny-moe", "--gpus", "2", "--layout", "dp=2", "--dtype", "fp16"],
                         "fp16 with MoE"),
                        (["run", "--model", "tiny-moe", "--gpus", "2", "--dtype", "fp16"], "fp16 with MoE")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0]


def test_fp16_leaves_only_pipeline_layouts_out():
    tiny = as_trained(TINY, "cpu", "fp16")
    pipelined, flat = (resolve(text, TINY, 2) for text in ("pp=2", "dp=2"))
    assert precision_refusal(tiny, pipelined.pp) and precision_refusal(tiny, flat.pp) is None
    assert precision_refusal(as_trained(TINY, "cpu", "bf16"), pipelined.pp) is None
