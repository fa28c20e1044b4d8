"""A torchtitan 0.3.0 command line for a layout (torchtitan.sh).

torchtitan 0.3.0 reads no TOML: a Python config function (`--module llama3 --config
llama3_8b`) gives the model and its defaults, and `--section.key value` overrides
change them, parsed by its ConfigManager (tyro); activation checkpointing is chosen
by a trailing `activation-checkpoint:<mode>`. The model's dimensions live in the
config function, so a model torchtitan ships no config for starts from the nearest
one, named in the mapping, whose dimensions the user replaces in a config function of
their own.

torchtitan's EP borrows ranks from FSDP and TP (dp_shard*cp*tp = efsdp*ep); ours
carves EP from dp_shard x cp only, so the two agree where tp = 1.
"""

from __future__ import annotations

import shlex

from autotune.config import GIB
from autotune.estimate.memory import precision, rank_shape
from autotune.export import Export, Mapping, Target, comment_block, flag_lines
from autotune.plan.schedules import SCHEDULES

# Our presets that torchtitan 0.3.0 has a config function for: (module, config).
CONFIGS = {
    "llama3-8b": ("llama3", "llama3_8b"),
    "llama3-70b": ("llama3", "llama3_70b"),
    "llama3-405b": ("llama3", "llama3_405b"),
    "qwen3-30b-a3b": ("qwen3", "qwen3_30b_a3b"),
}
# Configs whose model_spec converts the Linears to float8 (model_spec is not a command-line field).
FLOAT8_CONFIGS = {"llama3-405b"}
# Where a model has none: the nearest to start from (a small one for our tiny presets).
START_FROM = {"tiny": ("llama3", "llama3_debugmodel"), "tiny-moe": ("qwen3", "qwen3_moe_debug")}
DENSE_START, MOE_START = ("llama3", "llama3_8b"), ("qwen3", "qwen3_30b_a3b")

# torchtitan 0.3.0's eager cross_entropy_loss at its peak, bytes a logit, the logits included, at
# bf16 and fp32 alike (log_softmax's fp32 output and the gradients; benchmarks/loss_memory.py).
EAGER_LOSS_BYTES = 12

AC_MODES = {"none": "none", "selective": "selective", "op": "selective", "full": "full"}


def config_for(t: Target) -> tuple[str, str, Mapping]:
    """torchtitan's --module and --config for the model, with how well they match."""
    name = t.model.name
    if name in CONFIGS:
        module, config = CONFIGS[name]
        if name in FLOAT8_CONFIGS:
            return module, config, Mapping(
                f"model {name}", "approximate", f"--module {module} --config {config}",
                f"torchtitan's own config of this model, which also converts its Linears (but lm_head) to "
                f"float8 (not settable on the command line): for {t.model.dtype} as measured, copy it into a "
                "config function of your own without that converter")
        return module, config, Mapping(f"model {name}", "exact", f"--module {module} --config {config}",
                                       "torchtitan's own config of this model")
    module, config = START_FROM.get(name, MOE_START if t.model.moe else DENSE_START)
    return module, config, Mapping(
        f"model {name}", "approximate", f"--module {module} --config {config}",
        f"torchtitan 0.3.0 has no config of {name}: start from {module}.{config} "
        f"({'a token-choice MoE' if t.model.moe else 'a dense decoder'}), copy it into a config function of your "
        "own with this model's dimensions, and pass that function's module and name instead")


def torchtitan(t: Target) -> Export:
    L, m, maps = t.layout, t.model, []
    if m.hybrid_pattern is not None:
        return Export("torchtitan", "torchtitan.sh", None,
                      reason="torchtitan 0.3.0 has no hybrid Mamba-2 / Transformer model")
    module, config, model_map = config_for(t)
    args = ["--module", module, "--config", config]
    maps.append(model_map)

    def add(ours: str, status: str, values: dict | list[str], note: str = "") -> None:
        """Write {section.key: value} as tyro's flags (bools as --section.key / --section.no-key),
        or a list of arguments as it is."""
        written = list(values) if isinstance(values, list) else []
        for key, value in values.items() if isinstance(values, dict) else ():
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                section, _, name = flag.partition(".")
                written.append(flag if value else f"{section}.no-{name}")
            else:
                written += [flag, str(value)]
        args.extend(written)
        maps.append(Mapping(ours, status, " ".join(written), note))

    _data_parallel(t, add)
    add(f"tp={L.tp}", "exact", {"parallelism.tensor_parallel_degree": L.tp})
    if L.tp > 1:
        add(f"sp={L.sp}", "exact", {"parallelism.enable_sequence_parallel": bool(L.sp)})
    add(f"pp={L.pp}", "exact", {"parallelism.pipeline_parallel_degree": L.pp})
    if L.pp > 1:
        _pipeline(t, add)
    add(f"cp={L.cp}", "exact" if L.cp == 1 else "approximate", {"parallelism.context_parallel_degree": L.cp},
        "" if L.cp == 1 else "the same head-tail load balancing; torchtitan exchanges KV with torch's "
                             "context_parallel where ours passes KV blocks round a ring")
    if m.moe is not None or L.ep > 1:
        add(f"ep={L.ep}", "exact" if L.tp == 1 or L.ep == 1 else "approximate",
            {"parallelism.expert_parallel_degree": L.ep},
            "" if L.ep == 1 else "EP carved from dp_shard x cp, as ours" if L.tp == 1 else
            f"the same {m.moe.num_experts // L.ep} experts per rank, but torchtitan's EP groups take ranks from "
            "dp_shard x cp x tp, ours from dp_shard x cp")
    add("eager steps (no CUDA graphs)", "exact", {"training.disable_cuda_graphs": True},
        "as ours; torchtitan 0.3.0 captures CUDA graphs by default and refuses them with PP")
    local = L.mbs * t.grad_accum if L.pp > 1 else L.mbs
    add(f"mbs={L.mbs}, grad_accum={t.grad_accum}", "exact",
        {"training.local_batch_size": local, "training.global_batch_size": m.global_batch_size,
         "training.seq_len": m.seq_len},
        "torchtitan accumulates global / (local x dp) steps" if L.pp == 1 else
        f"one local batch of {t.grad_accum} pipeline micro-batches of {L.mbs} per step")
    if m.dtype == "bf16":
        reduce = "bfloat16" if m.grad_dtype == "bf16" else "float32"
        add(f"dtype=bf16, grad_dtype={m.grad_dtype}", "exact",
            {"training.mixed_precision_param": "bfloat16", "training.mixed_precision_reduce": reduce},
            f"bf16 compute on fp32 weights, gradients reduced in {m.grad_dtype}")
    elif m.dtype == "fp32":
        add("dtype=fp32", "exact", {"training.mixed_precision_param": "float32"})
    else:
        maps.append(Mapping(f"dtype={m.dtype}", "none", "", "torchtitan selects it by its model converters"))
    add("loss (chunked: the logits' gradient beside them)", "exact",
        ["--compile.enable", "--compile.components", "loss"], _loss_note(t))
    add("TP collectives not overlapped with matmuls", "exact", {"compile.enable_async_tensor_parallel": False},
        "as ours; torchtitan's async TP needs the blocks compiled, and a config that turns it on (llama3_405b) "
        "is refused by torchtitan's parser with only the loss compiled")
    mode = AC_MODES[L.recompute]
    exact = L.recompute in ("none", "op") or (L.recompute == "full" and not L.recompute_layers)
    note = {"selective": "torchtitan's selective checkpointing is per-op (it keeps every other matmul output), "
                         "not the attention core alone",
            "op": "per-op, the same policy as ours: every other matmul output kept, the rest recomputed",
            "full": "torchtitan recomputes every layer, ours the first K of each stage" if L.recompute_layers
            else "every layer recomputed from its input"}.get(L.recompute, "")
    args.append(f"activation-checkpoint:{mode}")
    maps.append(Mapping(f"recompute={L.recompute}" + (f":{L.recompute_layers}" if L.recompute_layers else ""),
                        "exact" if exact else "approximate", f"activation-checkpoint:{mode}", note))
    return Export("torchtitan", "torchtitan.sh", script(t, maps, args), maps, args=args, beyond_ours=[])


def _loss_note(t: Target) -> str:
    """Why the loss is compiled, in GiB at this layout (benchmarks/loss_memory.py): eager,
    torchtitan's cross-entropy upcasts the whole logits to fp32 and holds 12 bytes a logit
    at its peak; compiled, the logits and their gradient, as ours."""
    compiled = 2 * (4 if t.model.dtype == "fp32" else 2) * t.logits
    return (f"torchtitan's eager loss upcasts the logits to fp32: {EAGER_LOSS_BYTES * t.logits / GIB:.3g} GiB at "
            f"its peak for the {t.logits:,.0f} logits of a micro-batch here; compiled, {compiled / GIB:.3g} GiB (the "
            "logits and their gradient), as ours. Only the loss is compiled: the blocks run eager, as they were "
            "measured")


def _data_parallel(t: Target, add) -> None:
    L = t.layout
    if L.dp == 1 or L.zero == 0:
        add(f"dp={L.dp}, zero=0", "exact" if L.cp == 1 else "approximate",
            {"parallelism.data_parallel_replicate_degree": L.dp, "parallelism.data_parallel_shard_degree": 1},
            ("replicated weights, gradients all-reduced" if L.cp == 1 else
             "torchtitan always shards the weights over the cp ranks (FSDP over dp_shard x cp); ours keeps "
             "them whole"))
        return
    reshard = "always" if L.zero == 3 and L.pp == 1 else "never"  # under PP ours keeps them gathered (dp.py)
    values = {"parallelism.data_parallel_replicate_degree": L.dp_replicate,
              "parallelism.data_parallel_shard_degree": L.dp_shard,
              "parallelism.fsdp_reshard_after_forward": reshard}
    hsdp = "; HSDP across the replicas" if L.dp_shard < L.dp else ""
    if L.zero in (2, 3):
        under_pp = f"; {_pipeline_gradients_note(t)}" if L.pp > 1 else ""
        add(f"dp={L.dp}, dp_shard={L.dp_shard}, zero={L.zero}", "exact", values,
            f"FSDP2 over dp_shard (x cp){hsdp}{under_pp}")
    else:
        add(f"dp={L.dp}, dp_shard={L.dp_shard}, zero=1", "approximate", values,
            "torchtitan has no optimizer-only sharding (ZeRO-1): the nearest, FSDP2 without resharding after "
            f"forward (zero=2), is written{hsdp}")


def _pipeline_gradients_note(t: Target) -> str:
    held = max(rank_shape(t.model, t.layout, rank).total_params for rank in range(t.layout.pp)) * \
        precision(t.model, "cuda").grad
    return (f"under PP torch's PipelineStage turns FSDP's gradient reduction off until a stage's last "
            f"micro-batch, so torchtitan, as ours, holds the stage's unsharded {t.model.grad_dtype} gradients "
            f"through the step ({held / GIB:.3g} GiB a rank here, priced) and reduces them once")


def _pipeline(t: Target, add) -> None:
    L = t.layout
    sizes = [len(span) for span in t.stage_layers]
    parts = []
    for i, span in enumerate(t.stage_layers):
        names = [f"layers.{k}" for k in span]
        if i == 0:
            names.insert(0, "tok_embeddings")
        if i == len(t.stage_layers) - 1:
            names += ["norm", "lm_head"]
        parts.append(",".join(names))
    schedule = SCHEDULES[L.schedule].torchtitan
    add(f"schedule={L.schedule}", "exact", {"parallelism.pipeline_parallel_schedule": schedule},
        "the same torch.distributed.pipelining schedule")
    add(f"vpp={L.vpp}, stages {sizes}", "exact", ["--parallelism.module-fqns-per-model-part", *parts],
        f"every stage's modules named, in stage order: {len(parts)} stages on {L.pp} ranks")
    add(f"mbs={L.mbs} (pipeline micro-batch)", "exact", {"parallelism.pipeline_parallel_microbatch_size": L.mbs})


def script(t: Target, maps: list[Mapping], args: list[str]) -> str:
    L, nodes = t.layout, t.nodes
    launch = f"torchrun --nproc-per-node={t.gpus // nodes}" + (
        " --standalone" if nodes == 1 else
        f" --nnodes={nodes} --rdzv-backend=c10d --rdzv-endpoint=\"${{MASTER_ADDR:?}}:${{MASTER_PORT:-29500}}\"")
    lines = ["#!/usr/bin/env bash", f"# torchtitan 0.3.0 for the layout: {L.short()} on {t.gpus} GPUs.",
             "# Run from a torchtitan checkout (its assets), on each node; extra arguments are passed on:",
             "#   ./torchtitan.sh --training.steps 1000", "#", *comment_block(maps), "",
             "set -euo pipefail", "TORCHTITAN_ARGS=("]
    *options, mode = args  # the activation-checkpoint subcommand comes last, after any extra options
    lines += [f"  {' '.join(map(shlex.quote, line))}" for line in flag_lines(options)]
    lines += [")", f"exec {launch} -m torchtitan.train \"${{TORCHTITAN_ARGS[@]}}\" \"$@\" {mode}", ""]
    return "\n".join(lines)


