"""torchtitan settings for a layout."""

from __future__ import annotations

import json

from autotune.export import Export, Mapping, Target, comment_block
from autotune.schedules import SCHEDULES


def torchtitan(t: Target) -> Export:
    L, m, maps = t.layout, t.model, []
    par: dict = {}
    other_dims = L.tp > 1 or L.pp > 1 or L.cp > 1
    if L.dp == 1:
        par.update(data_parallel_replicate_degree=1, data_parallel_shard_degree=1)
        maps.append(Mapping("dp=1", "exact", "data_parallel_*_degree = 1"))
    elif L.zero == 0 and not other_dims:
        par.update(data_parallel_replicate_degree=L.dp, data_parallel_shard_degree=1)
        maps.append(Mapping(f"dp={L.dp}, zero=0", "exact", f"data_parallel_replicate_degree = {L.dp}",
                            "plain data parallel (DDP)"))
    else:
        par.update(data_parallel_replicate_degree=L.dp_replicate, data_parallel_shard_degree=L.dp_shard,
                   fsdp_reshard_after_forward="always" if L.zero == 3 else "never")
        written = (f"data_parallel_shard_degree = {L.dp_shard}, replicate = {L.dp_replicate}, "
                   f"fsdp_reshard_after_forward = \"{par['fsdp_reshard_after_forward']}\"")
        if L.zero in (2, 3):
            maps.append(Mapping(f"dp={L.dp}, dp_shard={L.dp_shard}, zero={L.zero}", "exact", written,
                                "FSDP2 over dp_shard (x cp), as ours" + ("; HSDP across the replicas"
                                                                         if L.dp_shard < L.dp else "")))
        else:
            why = ("torchtitan has no ZeRO-1 (optimizer-only sharding)" if L.zero == 1 else
                   "torchtitan's DDP does not combine with TP, PP or CP")
            maps.append(Mapping(f"dp={L.dp}, zero={L.zero}", "approximate", written,
                                f"{why}: the nearest, FSDP without resharding after forward (zero=2), is written"))
    par["tensor_parallel_degree"] = L.tp
    maps.append(Mapping(f"tp={L.tp}", "exact", f"tensor_parallel_degree = {L.tp}"))
    if L.tp > 1:
        par["enable_async_tensor_parallel"] = False
        maps.append(Mapping(f"sp={L.sp}", "exact" if L.sp else "approximate",
                            "" if L.sp else "# enable_sequence_parallel = false",
                            "torchtitan's TP includes sequence parallel" if L.sp else
                            "TOML-era torchtitan always adds sequence parallel to TP; newer versions take "
                            "enable_sequence_parallel = false (written commented out)"))
    par["pipeline_parallel_degree"] = L.pp
    maps.append(Mapping(f"pp={L.pp}", "exact", f"pipeline_parallel_degree = {L.pp}"))
    if L.pp > 1:
        split_points = [f"layers.{span.start}" for span in t.stage_layers[1:]]
        par.update(pipeline_parallel_schedule=SCHEDULES[L.schedule].torchtitan,
                   pipeline_parallel_split_points=split_points, pipeline_parallel_microbatch_size=L.mbs)
        maps.append(Mapping(f"schedule={L.schedule}", "exact",
                            f"pipeline_parallel_schedule = \"{SCHEDULES[L.schedule].torchtitan}\"",
                            "the same torch.distributed.pipelining schedule"))
        maps.append(Mapping(f"vpp={L.vpp}, stages {[len(span) for span in t.stage_layers]} layers", "exact",
                            f"pipeline_parallel_split_points = {split_points}",
                            "each split point starts a stage, so the stages hold our layers; newer torchtitan "
                            "names every stage's modules in module_fqns_per_model_part instead"))
    par["context_parallel_degree"] = L.cp
    maps.append(Mapping(f"cp={L.cp}", "exact" if L.cp == 1 else "approximate", f"context_parallel_degree = {L.cp}",
                        "" if L.cp == 1 else "the same head-tail sharding; torchtitan exchanges KV with torch's "
                                             "context_parallel (all-gather by default) where ours passes a ring"))
    par["expert_parallel_degree"] = L.ep
    maps.append(Mapping(f"ep={L.ep}", "exact", f"expert_parallel_degree = {L.ep}",
                        "EP carved from dp_shard x cp in both" if L.ep > 1 else ""))
    training = {"local_batch_size": L.mbs * t.grad_accum if L.pp > 1 else L.mbs,
                "global_batch_size": m.global_batch_size, "seq_len": m.seq_len,
                "mixed_precision_param": "bfloat16" if m.dtype == "bf16" else "float32",
                "mixed_precision_reduce": "float32"}
    maps.append(Mapping(f"mbs={L.mbs}, grad_accum={t.grad_accum}", "exact",
                        f"local_batch_size = {training['local_batch_size']}, global_batch_size = "
                        f"{m.global_batch_size}" + (f", pipeline_parallel_microbatch_size = {L.mbs}" if L.pp > 1
                                                    else ""),
                        "torchtitan derives the accumulation from global / (local x dp)" if L.pp == 1 else
                        f"{t.grad_accum} pipeline micro-batches per step (newer torchtitan: num_pp_microbatches = "
                        f"{t.grad_accum})"))
    ac = {"mode": L.recompute}
    if L.recompute == "selective":
        ac["selective_ac_option"] = "op"
    maps.append(Mapping(f"recompute={L.recompute}", "approximate" if L.recompute == "selective" else "exact",
                        f"[activation_checkpoint] mode = \"{L.recompute}\"",
                        "torchtitan's op-level selective checkpointing saves some matmuls and recomputes the "
                        "rest, not exactly the attention core" if L.recompute == "selective" else ""))
    lines = [f"# torchtitan settings for the layout autotune recommends: {L.short()} on {t.gpus} GPUs.",
             "# Merge into your train config (TOML JobConfig); keys follow torchtitan's [parallelism],",
             "# [training] and [activation_checkpoint] sections.", "#", *comment_block(maps), "",
             "[parallelism]", *toml_items(par)]
    if L.tp > 1 and not L.sp:
        lines.append("# enable_sequence_parallel = false   # newer torchtitan only")
    lines += ["", "[training]", *toml_items(training), "", "[activation_checkpoint]", *toml_items(ac)]
    return Export("torchtitan", "torchtitan.toml", "\n".join(lines) + "\n", maps)


def toml_items(values: dict) -> list[str]:
    return [f"{k} = {json.dumps(v)}" for k, v in values.items()]  # ints, bools, strings: JSON == TOML here
