"""A DeepSpeed config for a layout, where DeepSpeed's config can express it."""

from __future__ import annotations

import json

from autotune.export import Export, Mapping, Target


def deepspeed(t: Target) -> Export:
    L, m, maps = t.layout, t.model, []
    why_not = [reason for cond, reason in (
        (L.pp > 1, "pipeline parallel is DeepSpeed's PipelineModule, set up in code (and limited to ZeRO-1)"),
        (L.cp > 1, "DeepSpeed has no ring-attention context parallel (Ulysses splits heads instead)"),
        (L.tp > 1 and L.zero == 3, "DeepSpeed's AutoTP training combines with ZeRO stages 0-2 only"),
    ) if cond]
    if why_not:
        return Export("DeepSpeed", "deepspeed.json", None, reason="; ".join(why_not))
    config: dict = {"train_batch_size": m.global_batch_size, "train_micro_batch_size_per_gpu": L.mbs,
                    "gradient_accumulation_steps": t.grad_accum, "zero_optimization": {"stage": L.zero}}
    maps.append(Mapping(f"mbs={L.mbs}, grad_accum={t.grad_accum}", "exact",
                        f"train_micro_batch_size_per_gpu = {L.mbs}, gradient_accumulation_steps = {t.grad_accum}, "
                        f"train_batch_size = {m.global_batch_size}"))
    maps.append(Mapping(f"zero={L.zero}", "exact", f"zero_optimization.stage = {L.zero}"))
    if L.dp > 1 and L.dp_shard < L.dp:
        if L.zero == 3:
            config["zero_optimization"]["mics_shard_size"] = L.dp_shard
            maps.append(Mapping(f"dp_shard={L.dp_shard} (HSDP)", "approximate", f"mics_shard_size = {L.dp_shard}",
                                "MiCS shards within groups and replicates across them; build the model under "
                                "deepspeed.zero.MiCS_Init"))
        else:
            maps.append(Mapping(f"dp_shard={L.dp_shard} (HSDP)", "none", "",
                                "ZeRO-1/2 shard over every data-parallel rank: state is split dp ways, not "
                                f"{L.dp_shard}"))
    if L.tp > 1:
        config["tensor_parallel"] = {"autotp_size": L.tp}
        maps.append(Mapping(f"tp={L.tp}", "approximate", f"tensor_parallel.autotp_size = {L.tp}",
                            "AutoTP shards the model's Linear layers by its own rules"))
        if L.sp:
            maps.append(Mapping("sp=1", "none", "", "AutoTP has no sequence parallel"))
    if L.ep > 1:
        maps.append(Mapping(f"ep={L.ep}", "none", "", "DeepSpeed-MoE takes ep_size in code "
                                                      "(deepspeed.moe.layer.MoE), not in the config"))
    if L.recompute != "none":
        maps.append(Mapping(f"recompute={L.recompute}", "none", "",
                            "checkpointing is called from the model's code (deepspeed.checkpointing.checkpoint "
                            "or your model's gradient checkpointing); the config only tunes it"))
    if m.dtype == "bf16":
        config["bf16"] = {"enabled": True}
        maps.append(Mapping("dtype=bf16", "exact", "bf16.enabled = true"))
    return Export("DeepSpeed", "deepspeed.json", json.dumps(config, indent=2) + "\n", maps)
