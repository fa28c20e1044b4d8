"""A DeepSpeed (>= 0.19.5) config for a layout, where DeepSpeed's config can express it.

DeepSpeedConfig checks train_batch_size = micro batch x accumulation x its world size,
and its world size is the data-parallel size only when the caller passes an mpu;
without one it is every rank, TP ranks included. So under AutoTP train_batch_size is
left out: DeepSpeed derives it from the other two, and the config passes either way.
AutoTP combines with ZeRO-3 since 0.19.5, and expert parallel is a config key since
0.19.2 (`expert_parallel.autoep_size`; AutoEP groups experts over the ranks of a
stage, TP lanes included, and takes TP only from the config, not from an mpu).
"""

from __future__ import annotations

import json

from autotune.export import Export, Mapping, Target


def deepspeed(t: Target) -> Export:
    L, m, maps = t.layout, t.model, []
    why_not = [reason for cond, reason in (
        (L.pp > 1, "pipeline parallel is DeepSpeed's PipelineModule, set up in code"),
        (L.cp > 1, "DeepSpeed has no ring-attention context parallel (Ulysses splits heads instead)"),
        (m.hybrid_pattern is not None, "DeepSpeed has no hybrid Mamba-2 / Transformer model: the model is your own "
                                       "code there, and its tensor parallel (AutoTP) cannot cut Mamba-2 blocks"),
    ) if cond]
    if why_not:
        return Export("DeepSpeed", "deepspeed.json", None, reason="; ".join(why_not))
    config: dict = {"train_micro_batch_size_per_gpu": L.mbs, "gradient_accumulation_steps": t.grad_accum}
    if L.tp == 1:
        config = {"train_batch_size": m.global_batch_size, **config}
        maps.append(Mapping(f"mbs={L.mbs}, grad_accum={t.grad_accum}", "exact",
                            f"train_micro_batch_size_per_gpu = {L.mbs}, gradient_accumulation_steps = "
                            f"{t.grad_accum}, train_batch_size = {m.global_batch_size}"))
    else:
        maps.append(Mapping(f"mbs={L.mbs}, grad_accum={t.grad_accum}", "exact",
                            f"train_micro_batch_size_per_gpu = {L.mbs}, gradient_accumulation_steps = "
                            f"{t.grad_accum}",
                            f"train_batch_size ({m.global_batch_size}) left out: without an mpu DeepSpeedConfig "
                            f"counts the TP ranks as data parallel and would refuse it; it derives its own from "
                            "these two"))
    config["zero_optimization"] = {"stage": L.zero}
    maps.append(Mapping(f"zero={L.zero}", "exact", f"zero_optimization.stage = {L.zero}"))
    if L.dp > 1 and L.dp_shard < L.dp:
        maps.append(Mapping(f"dp_shard={L.dp_shard} (HSDP)", "none", "",
                            f"ZeRO shards over every data-parallel rank: state is split dp ({L.dp}) ways, not "
                            f"{L.dp_shard} (DeepSpeed removed MiCS, its sharding within groups)"))
    if L.tp > 1:
        config["tensor_parallel"] = {"autotp_size": L.tp}
        maps.append(Mapping(f"tp={L.tp}", "approximate", f"tensor_parallel.autotp_size = {L.tp}",
                            "AutoTP shards the model's Linear layers by its own rules"
                            + ("; with ZeRO-3 since DeepSpeed 0.19.5" if L.zero == 3 else "")))
        if L.sp:
            maps.append(Mapping("sp=1", "none", "", "AutoTP has no sequence parallel"))
    if L.ep > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": L.ep}
        maps.append(Mapping(f"ep={L.ep}", "exact" if L.tp == 1 else "approximate",
                            f"expert_parallel = {{enabled: true, autoep_size: {L.ep}}}",
                            f"{m.moe.num_experts // L.ep} experts per rank; AutoEP finds the MoE layers of known "
                            "models (else set its expert_pattern and router_pattern)"
                            + ("" if L.tp == 1 else "; its EP groups span TP lanes, ours carve EP from dp_shard, "
                                                   "and it takes TP from the config only: pass no mpu")))
    if L.recompute != "none":
        maps.append(Mapping(f"recompute={L.recompute}", "none", "",
                            "checkpointing is called from the model's code (deepspeed.checkpointing.checkpoint "
                            "or your model's gradient checkpointing); the config only tunes it"))
    if m.dtype == "bf16":
        config["bf16"] = {"enabled": True}
        maps.append(Mapping("dtype=bf16", "exact", "bf16.enabled = true"))
        maps.append(_gradients(config, m.grad_dtype, L.zero))
    elif m.dtype != "fp32":
        maps.append(Mapping(f"dtype={m.dtype}", "none", "", "not translated"))
    return Export("DeepSpeed", "deepspeed.json", json.dumps(config, indent=2) + "\n", maps)


def _gradients(config: dict, grad_dtype: str, zero: int) -> Mapping:
    """The gradients' precision under bf16. DeepSpeed accumulates and reduces in the model's
    dtype unless told otherwise; fp32 accumulation it keeps only at ZeRO stage 1 (its
    BF16_Optimizer), and refuses without ZeRO."""
    if grad_dtype == "bf16":
        config["data_types"] = {"grad_accum_dtype": "bf16"}
        config["communication_data_type"] = "bf16"
        return Mapping("grad_dtype=bf16", "exact", "data_types.grad_accum_dtype = bf16, communication_data_type = bf16")
    config["communication_data_type"] = "fp32"
    if zero == 1:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        return Mapping("grad_dtype=fp32", "exact", "data_types.grad_accum_dtype = fp32, communication_data_type = fp32")
    return Mapping("grad_dtype=fp32", "approximate", "communication_data_type = fp32",
                   f"reduced in fp32, but DeepSpeed accumulates bf16 gradients at ZeRO stage {zero}")
