"""Exports of hybrid Mamba-2 / Transformer layouts: Megatron-LM's hybrid flags through the
rules of its argument validation (support/megatron_rules.py); torchtitan and DeepSpeed say
in one line that they have no such model."""

from pathlib import Path

import pytest

from autotune.config import load_model
from autotune.export import Target
from autotune.export.deepspeed import deepspeed
from autotune.export.megatron import megatron
from autotune.export.torchtitan import torchtitan
from autotune.plan.layout import resolve
from support import megatron_rules

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
LAYOUTS = [("nemotron-h-8b.json", 16, "tp=4,sp=1,dp=4,zero=1,mbs=1"),
           ("nemotron-h-56b.json", 64, "tp=8,sp=1,dp=8,zero=1,mbs=1,recompute=full"),
           ("nemotron-3-nano-30b-a3b.json", 16, "tp=2,sp=1,ep=8,dp=8,zero=1,mbs=1"),
           ("nvidia-nemotron-nano-9b-v2.json", 8, "dp=8,zero=3,mbs=2")]


def target(fixture: str, gpus: int, text: str) -> Target:
    model = load_model(str(FIXTURES / fixture))
    return Target(resolve(text, model, gpus, 8), model, gpus, 8)


@pytest.mark.parametrize("fixture, gpus, text", LAYOUTS)
def test_megatron_hybrid_flags_pass_its_validation(fixture, gpus, text):
    t = target(fixture, gpus, text)
    x = megatron(t)
    assert x.content is not None, x.reason
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if t.layout.tp > 1 and t.layout.zero < 2 else {}
    args = megatron_rules.check(x.args, env, gpus, t.model.num_layers, t.grad_accum)
    m = t.model.mamba
    assert args.get("--hybrid-layer-pattern") == t.model.hybrid_pattern
    assert (args.int("--mamba-num-heads"), args.int("--mamba-head-dim"), args.int("--mamba-state-dim"),
            args.int("--mamba-num-groups")) == (m.num_heads, m.head_dim, m.state_size, m.n_groups)
    assert "--hybrid-layer-pattern" in x.content


@pytest.mark.parametrize("argv, message", [
    (["--hybrid-layer-pattern", "M*M-", "--hybrid-override-pattern", "M*M-"], "cannot both be specified"),
    (["--hybrid-layer-pattern", "M*M"], "does not match the number of layers"),
    (["--hybrid-layer-pattern", "M*M-", "--mamba-num-heads", "6"], "nheads must be evenly divisible by tp"),
    (["--hybrid-layer-pattern", "M*M-", "--mamba-num-heads", "8", "--mamba-num-groups", "1"],
     "ngroups must be evenly divisible by tp"),
])
def test_the_hybrid_rules_catch_what_megatron_refuses(argv, message):
    base = ["--tensor-model-parallel-size", "4", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--seq-length", "64"]
    with pytest.raises(AssertionError, match=message):
        megatron_rules.check(base + argv, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, 8, 4)


def test_what_megatron_cannot_be_given_and_the_other_frameworks_refuse_in_one_line():
    pipelined = megatron(target("nemotron-h-8b.json", 8, "pp=2,dp=4,zero=1,schedule=1f1b,mbs=1"))
    assert pipelined.content is None and "pipeline parallel of a hybrid pattern" in pipelined.reason
    t = target("nemotron-h-8b.json", 16, "tp=4,sp=1,dp=4,zero=1,mbs=1")
    for export, words in ((torchtitan(t), "has no hybrid Mamba-2 / Transformer model"),
                          (deepspeed(t), "has no hybrid Mamba-2 / Transformer model")):
        assert export.content is None and words in export.reason and "\n" not in export.reason
