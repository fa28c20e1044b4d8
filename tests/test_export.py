"""Exports that the frameworks accept: every export of the layouts in support/export_layouts.py
through Megatron-LM's validation rules (support/megatron_rules.py) and DeepSpeed's own
DeepSpeedConfig; `autotune export` writes best/ and refuses bad input with exit code 2.
torchtitan's own parser runs in test_export_torchtitan.py (it imports for seconds)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from autotune.cli import main
from autotune.export.deepspeed import deepspeed
from autotune.export.megatron import megatron
from autotune.export.megatron_pipeline import layout_string, microbatch_group
from autotune.export.torchtitan import torchtitan
from support import megatron_rules
from support.export_layouts import targets
from support.frameworks import require

TARGETS = targets()
IDS = [name for name, _ in TARGETS]


def megatron_env(export) -> dict:
    line = next(mp.theirs for mp in export.mappings if mp.ours == "environment")
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if line == "export CUDA_DEVICE_MAX_CONNECTIONS=1" else {}


@pytest.mark.parametrize("t", [t for _, t in TARGETS], ids=IDS)
def test_megatron_export_passes_megatron_validation(t):
    x = megatron(t)
    assert x.content is not None, x.reason
    args = megatron_rules.check(x.args, megatron_env(x), t.gpus, t.model.num_layers, t.grad_accum)
    L = t.layout
    assert (args.int("--tensor-model-parallel-size"), args.int("--pipeline-model-parallel-size"),
            args.int("--context-parallel-size")) == (L.tp, L.pp, L.cp)
    if L.pp > 1:  # the stages hold our layers, in our order
        layout = args.get("--pipeline-model-parallel-layout")
        counts = ([stage.count("t") for stage in megatron_rules.layout_stages(layout)] if layout else
                  [t.model.num_layers // (L.pp * L.vpp)] * (L.pp * L.vpp))
        assert counts == [len(span) for span in t.stage_layers]
    if L.ep > 1:
        assert args.int("--expert-model-parallel-size") == L.ep and args.int("--expert-tensor-parallel-size") == 1
        assert args.get("--moe-token-dispatcher-type") == "alltoall" and args.on("--moe-grouped-gemm")
    if L.dp * L.cp > 1:
        assert args.on("--overlap-grad-reduce")
    for mp in x.mappings:
        assert mp.status in ("exact", "approximate", "none") and (mp.status != "approximate" or mp.note)


def test_uneven_virtual_stages_are_a_layout_not_first_and_last_counts():
    """Megatron counts --decoder-first-pipeline-num-layers per rank over its virtual stages
    (9 layers on rank 0 of llama3-70b interleaved do not divide by vpp 2): the layout
    string names each virtual stage instead."""
    t = dict(TARGETS)["llama3-70b:64:tp=8,sp=1,pp=4,dp=2,zero=1,schedule=interleaved_1f1b,vpp=2,mbs=1"]
    args = megatron(t).args
    assert "--decoder-first-pipeline-num-layers" not in args
    assert args[args.index("--pipeline-model-parallel-layout") + 1] == "Et*9|t*10|t*11|t*10|t*10|t*11|t*10|t*9L"
    with pytest.raises(AssertionError, match="must be divisible by virtual pipeline parallel degree 2"):
        megatron_rules.check_uneven(9 + 10, 10 + 9, 4, 80, 2)


def test_megatron_rules_catch_what_megatron_refuses():
    base = ["--micro-batch-size", "1", "--global-batch-size", "8", "--seq-length", "64"]
    ok = megatron_rules.check(["--tensor-model-parallel-size", "2", *base], {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
                              4, 8)
    assert ok.int("--tensor-model-parallel-size") == 2
    for argv, env, message in (
        (["--tensor-model-parallel-size", "2", *base], {}, "CUDA_DEVICE_MAX_CONNECTIONS=1"),
        (["--overlap-param-gather", "--overlap-grad-reduce", *base], {}, "distributed optimizer"),
        (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*3|t*4L", *base], {},
         "must match num_layers"),
        (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*4|t*4|t*0L", *base], {},
         "must divide by pp"),
        (["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", *base], {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
         "FSDP requires"),
        (["--expert-model-parallel-size", "4", "--num-experts", "6", *base], {}, "multiple of expert"),
        (["--recompute-granularity", "full", *base], {}, "recompute-method"),
        (["--no-such-flag", *base], {}, "unrecognized"),
    ):
        with pytest.raises(AssertionError, match=message):
            megatron_rules.check(argv, env, 4, 8)


def test_megatron_layout_string_and_microbatch_groups():
    assert layout_string([7, 9, 9, 7]) == "Et*7|t*9|t*9|t*7L"
    assert megatron_rules.layout_stages("E(tt|)*2,tL") == [["E", "t", "t"], ["t", "t"], ["t", "L"]]
    assert microbatch_group(4, 8) == 4 and microbatch_group(4, 6) == 6 and microbatch_group(4, 3) is None
    assert microbatch_group(4, 10) == 5  # torch's rounds: 10 // (10 // 4) = 5, and 10 % 5 == 0


def test_megatron_refuses_interleaving_with_too_few_microbatches():
    t = dict(TARGETS)["tiny:4:pp=2,dp=2,zero=1,schedule=interleaved_1f1b,vpp=2,mbs=1"]
    few = dataclasses.replace(t, model=dataclasses.replace(t.model, global_batch_size=2))
    x = megatron(few)
    assert x.content is None and "at least pp (2) micro-batches" in x.reason


def test_megatron_fsdp_leaves_the_connections_unset():
    t = dict(TARGETS)["mixtral-8x7b:16:tp=2,sp=1,ep=4,dp=8,zero=3,mbs=1"]
    x = megatron(t)
    assert "unset CUDA_DEVICE_MAX_CONNECTIONS" in x.content and "--use-megatron-fsdp" in x.args


class FakeMpu:
    """What DeepSpeedConfig asks of an mpu: the data-parallel world size."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


@pytest.fixture
def deepspeed_world(monkeypatch):
    """DeepSpeedConfig reads the world size from deepspeed.comm; give it `gpus` ranks."""
    require("deepspeed")
    import deepspeed.runtime.config as ds_config

    def set_world(gpus: int):
        monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
        monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: gpus)
    return set_world


@pytest.mark.parametrize("t", [t for _, t in TARGETS], ids=IDS)
def test_deepspeed_config_passes_deepspeed_with_and_without_an_mpu(t, deepspeed_world):
    from deepspeed.module_inject.auto_ep_config import validate_autoep_config
    from deepspeed.runtime.config import DeepSpeedConfig

    L, x = t.layout, deepspeed(t)
    if x.content is None:
        assert L.pp > 1 or L.cp > 1, x.reason
        return
    config = json.loads(x.content)
    deepspeed_world(t.gpus)
    for mpu in (None, FakeMpu(L.dp)):
        ds = DeepSpeedConfig(json.loads(x.content), mpu=mpu)
        assert (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (L.mbs, t.grad_accum)
        assert ds.zero_optimization_stage == L.zero
        if mpu is not None:
            assert ds.train_batch_size == t.model.global_batch_size
    assert ("train_batch_size" in config) == (L.tp == 1)
    if L.ep > 1:
        ds = DeepSpeedConfig(config)
        assert ds.expert_parallel_config.enabled and ds.expert_parallel_config.autoep_size == L.ep
        validate_autoep_config(ds.expert_parallel_config, t.gpus, 1, L.tp, 1, zero_stage=L.zero)
    if L.tp > 1:
        assert config["tensor_parallel"] == {"autotp_size": L.tp}


def test_deepspeed_autotp_with_zero3_is_written():
    t = dict(TARGETS)["mixtral-8x7b:16:tp=2,sp=1,ep=4,dp=8,zero=3,mbs=1"]
    config = json.loads(deepspeed(t).content)
    assert config["zero_optimization"]["stage"] == 3 and config["tensor_parallel"]["autotp_size"] == 2
    assert config["expert_parallel"] == {"enabled": True, "autoep_size": 4}


def test_torchtitan_ep_with_tp_is_approximate():
    by_id = dict(TARGETS)
    with_tp = torchtitan(by_id["mixtral-8x7b:16:tp=2,sp=1,ep=4,dp=8,zero=3,mbs=1"])
    without = torchtitan(by_id["mixtral-8x7b:16:ep=8,dp=16,dp_shard=8,zero=1,mbs=1"])
    status = [next(mp.status for mp in x.mappings if mp.ours.startswith("ep=")) for x in (with_tp, without)]
    assert status == ["approximate", "exact"]
    model = next(mp for mp in with_tp.mappings if mp.ours.startswith("model "))
    assert model.status == "approximate" and "start from qwen3.qwen3_30b_a3b" in model.note


def test_the_loss_notes_give_what_each_framework_holds_at_the_layout():
    """llama3-8b at mbs 2, seq 8192: 2 x 8192 x 128,256 logits a micro-batch; torchtitan's
    eager loss would hold 12 bytes each (it is compiled, holding 4, as ours), Megatron-LM's
    6 (benchmarks/loss_memory.py)."""
    t = dict(TARGETS)["llama3-8b:8:dp=8,zero=0,mbs=2"]
    logits = 2 * 8192 * 128_256
    titan = next(mp for mp in torchtitan(t).mappings if mp.ours.startswith("loss"))
    assert titan.status == "exact" and titan.theirs == "--compile.enable --compile.components loss"
    assert f"{12 * logits / 2**30:.3g} GiB at its peak" in titan.note and f"{4 * logits / 2**30:.3g} GiB" in titan.note
    meg = next(mp for mp in megatron(t).mappings if mp.ours.startswith("loss"))
    assert meg.status == "approximate" and f"{6 * logits / 2**30:.3g} GiB at its peak" in meg.note
    assert f"{2 * logits / 2**30:.3g} GiB more than the estimator prices" in meg.note


def test_torchtitan_fsdp_under_pp_names_the_unsharded_gradients():
    """torch's PipelineStage keeps FSDP's gradient reduction off until a stage's last
    micro-batch: llama3-8b's half (16 layers and the embedding or the head, about 4.0
    x 10^9 parameters) holds 15 GiB of fp32 gradients in torchtitan, as in ours, where the
    estimator prices them; under PP zero 3 keeps its parameters gathered, as ours does."""
    x = torchtitan(dict(TARGETS)["llama3-8b:16:pp=2,dp=8,zero=3,schedule=1f1b,mbs=1"])
    dp = next(mp for mp in x.mappings if mp.ours.startswith("dp="))
    assert dp.status == "exact" and "--parallelism.fsdp-reshard-after-forward never" in dp.theirs
    gib = float(re.search(r"unsharded fp32 gradients through the step \(([0-9.]+) GiB", dp.note).group(1))
    assert 14.5 < gib < 15.5 and x.beyond_ours == []
    without_pp = torchtitan(dict(TARGETS)["llama3-8b:16:dp=16,dp_shard=8,zero=3,mbs=2,recompute=selective"])
    dp = next(mp for mp in without_pp.mappings if mp.ours.startswith("dp="))
    assert dp.status == "exact" and "--parallelism.fsdp-reshard-after-forward always" in dp.theirs


def test_export_command_writes_best(tmp_path, capsys):
    out = tmp_path / "best"
    assert main(["export", "--model", "llama3-8b", "--gpus", "16", "--layout", "tp=2,pp=2,zero=1,sp=1",
                 "--out", str(out)]) == 0
    for name in ("README.md", "layout.txt", "model.yaml", "torchrun.sh", "megatron_args.sh", "torchtitan.sh",
                 "deepspeed.json"):
        assert (out / name).exists() != (name == "deepspeed.json"), name  # DeepSpeed has no pipeline config
    readme = (out / "README.md").read_text()
    assert "not measured" in readme and "| megatron_args.sh | Megatron-LM settings |" in readme
    layout_txt = (out / "layout.txt").read_text()
    assert layout_txt.startswith("tp=2,pp=2,cp=1,ep=1,dp=4,dp_shard=4,zero=1")
    assert "the layout given to `autotune export`" in layout_txt and "recommends" not in layout_txt


def test_best_readme_says_which_frameworks_fit_the_budget(tmp_path):
    """llama3-8b at pp=2 dp=8 zero=3 mbs=1: the estimator prices our runtime at about 63 GiB,
    the stage's unsharded fp32 gradients included (torch's pipeline stage reduces them once
    a step, in torchtitan as in ours: nothing beyond); Megatron-LM's loss holds an fp32 copy
    of the logits, 2 GiB more. Under a 64 GiB budget ours and torchtitan's fit, Megatron-LM's
    does not."""
    from autotune.config import load_hardware, load_model
    from autotune.estimate import estimate
    from autotune.plan.layout import resolve
    from autotune.record import Question
    from autotune.report.best import write_best

    model, hardware = load_model("llama3-8b"), load_hardware("h100-sxm")
    layout = resolve("pp=2,dp=8,zero=3,schedule=1f1b,mbs=1", model, 16, 8)
    question = Question(model=dataclasses.asdict(model), gpus=16, space={}, hardware=dataclasses.asdict(hardware),
                        device="cuda", memory_budget_gb=64, gpus_per_node=8)
    write_best(tmp_path, question, {"layout": str(layout)})
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in
            (tmp_path / "README.md").read_text().splitlines() if line.startswith("| ") and "GiB" in line}
    ours = estimate(model, layout, hardware).peak_mem_bytes / 2**30
    assert 60 < ours < 64 and rows["our runtime (torchrun.sh)"][2] == f"{ours:,.2f} GiB"
    titan = rows["torchtitan (torchtitan.sh)"]
    assert titan[1] == "nothing we know of" and titan[3] == "yes |"
    megatron = rows["Megatron-LM (megatron_args.sh)"]
    beyond = float(re.search(r"logits: ([0-9.]+) GiB", megatron[1]).group(1))
    assert 1.9 < beyond < 2.0 and megatron[3] == "**no** |"


@pytest.mark.parametrize("argv, message", [
    (["--layout", "tp=3"], "layout: tp*pp*cp = 3*1*1 = 3 must divide --gpus 16"),
    (["--layout", "ep=2"], "layout.ep: expert parallel needs an MoE model"),
    (["--layout", "nope=1"], "layout.nope: unknown key"),
    (["--layout", "tp=2", "--hardware", "no-such-gpu"], "hardware"),
])
def test_export_command_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    capsys.readouterr()
    assert main(["export", "--model", "llama3-8b", "--gpus", "16", "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["llama3-8b:8:dp=8,zero=0,mbs=2", "llama3-8b:16:dp=16,dp_shard=8,zero=1,mbs=2",
                                  "llama3-8b:16:dp=16,dp_shard=8,zero=3,mbs=2,recompute=selective"])
def test_bf16_gradients_are_exported_to_each_framework(name, deepspeed_world):
    """grad_dtype bf16: Megatron-LM's --grad-reduce-in-bf16, torchtitan's bf16
    mixed_precision_reduce, DeepSpeed's bf16 accumulation and communication; fp32
    gradients say so to each (DeepSpeed keeps fp32 accumulation at ZeRO 1 only)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    base = dict(TARGETS)[name]
    for grads in ("bf16", "fp32"):
        t = dataclasses.replace(base, model=dataclasses.replace(base.model, dtype="bf16", grad_dtype=grads))
        x = megatron(t)
        args = megatron_rules.check(x.args, megatron_env(x), t.gpus, t.model.num_layers, t.grad_accum)
        assert args.on("--bf16") and args.on("--grad-reduce-in-bf16") == (grads == "bf16")
        titan = torchtitan(t).args
        reduce_dtype = titan[titan.index("--training.mixed-precision-reduce") + 1]
        assert reduce_dtype == ("bfloat16" if grads == "bf16" else "float32")
        config = json.loads(deepspeed(t).content)
        deepspeed_world(t.gpus)
        ds = DeepSpeedConfig(config)
        assert ds.communication_data_type == (torch.bfloat16 if grads == "bf16" else torch.float32)
        accumulation = config.get("data_types", {}).get("grad_accum_dtype")
        assert accumulation == ("bf16" if grads == "bf16" else "fp32" if t.layout.zero == 1 else None)
        mapping = next(mp for mp in deepspeed(t).mappings if mp.ours.startswith("grad_dtype"))
        assert mapping.status == ("approximate" if grads == "fp32" and t.layout.zero != 1 else "exact")
    with pytest.raises(AssertionError, match="--grad-reduce-in-bf16 acts only with --bf16"):
        megatron_rules.check([a for a in x.args if a != "--bf16"] + ["--grad-reduce-in-bf16"], megatron_env(x),
                             t.gpus, t.model.num_layers, t.grad_accum)
