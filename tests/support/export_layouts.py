"""The layouts every export is checked on: each dimension alone, every pipeline schedule,
uneven splits with and without virtual stages, HSDP under each ZeRO stage, EP with and
without TP, each recompute mode. (model, GPUs, layout) as a user would pass them."""

from __future__ import annotations

from autotune.config import load_model
from autotune.export import Target
from autotune.plan.layout import resolve
from autotune.plan.schedules import SCHEDULES

LAYOUTS = [
    ("llama3-8b", 8, "dp=8,zero=0,mbs=2"),                                   # plain data parallel
    ("llama3-8b", 16, "dp=16,dp_shard=8,zero=1,mbs=2"),                      # ZeRO-1 HSDP
    ("llama3-8b", 16, "dp=16,dp_shard=8,zero=3,mbs=2,recompute=selective"),  # FSDP HSDP
    ("llama3-8b", 8, "tp=8,sp=1,dp=1,recompute=op"),                         # TP + SP
    ("llama3-8b", 16, "tp=4,dp=4,zero=2,mbs=1"),                             # TP without SP, FSDP
    ("llama3-8b", 16, "cp=4,tp=2,sp=1,dp=2,zero=1,mbs=1"),                   # CP
    ("llama3-8b", 8, "pp=4,dp=2,schedule=gpipe,mbs=2"),                      # uneven split 7,9,9,7
    ("llama3-8b", 8, "pp=2,dp=4,schedule=1f1b,zero=1,recompute=full"),
    ("llama3-70b", 64, "tp=8,sp=1,pp=4,dp=2,zero=1,schedule=interleaved_1f1b,vpp=2,mbs=1"),
    ("llama3-70b", 32, "tp=8,sp=1,pp=4,schedule=interleaved_1f1b,vpp=4,mbs=1"),
    ("llama3-8b", 16, "tp=2,sp=1,pp=4,dp=2,zero=1,schedule=zero_bubble,vpp=2,mbs=1"),
    ("llama3-8b", 16, "tp=2,sp=1,pp=4,dp=2,zero=1,schedule=zbv,vpp=2,mbs=1"),
    ("llama3-8b", 16, "tp=2,sp=1,pp=4,dp=2,schedule=dualpipev,vpp=2,mbs=1,recompute=full,recompute_layers=2"),
    ("tiny", 4, "pp=2,dp=2,zero=1,schedule=interleaved_1f1b,vpp=2,mbs=1"),   # even split with virtual stages
    ("mixtral-8x7b", 16, "ep=8,dp=16,dp_shard=8,zero=1,mbs=1"),              # EP without TP
    ("mixtral-8x7b", 16, "tp=2,sp=1,ep=4,dp=8,zero=3,mbs=1"),                # EP with TP
    ("qwen3-30b-a3b", 16, "tp=2,sp=1,ep=8,dp=8,zero=1,mbs=1"),
    ("qwen3-30b-a3b", 16, "pp=2,ep=8,dp=8,zero=1,schedule=1f1b,mbs=1"),      # EP under PP
    ("llama3-8b", 16, "pp=2,dp=8,zero=3,schedule=1f1b,mbs=1"),               # FSDP under PP
    ("llama3-405b", 128, "tp=8,sp=1,pp=16,schedule=interleaved_1f1b,vpp=2,mbs=1"),  # a config with async TP on
]


def targets() -> list[tuple[str, Target]]:
    """(id, Target) for each layout, resolved by the same rules as `autotune trial`."""
    out = []
    for model_name, gpus, text in LAYOUTS:
        model = load_model(model_name)
        layout = resolve(text, model, gpus, 8)
        out.append((f"{model_name}:{gpus}:{text}", Target(layout, model, gpus, 8)))
    return out


def schedules_covered() -> set[str]:
    return {t.layout.schedule for _, t in targets() if t.layout.pp > 1}


assert schedules_covered() == set(SCHEDULES), "every pipeline schedule is among the layouts"
