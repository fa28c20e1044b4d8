"""Megatron-LM arguments for a layout: flags of Megatron-LM main's training arguments.

What Megatron-LM's validation asks of them (tests/support/megatron_rules.py checks
each export against these rules):

- dp = world / (tp*pp*cp); global batch divisible by mbs * dp.
- One of --num-virtual-stages-per-pipeline-rank, --num-layers-per-virtual-pipeline-stage,
  --pipeline-model-parallel-layout; the layout's stage count divides by pp and its
  decoder layers add up to num_layers (megatron_pipeline.py).
- --overlap-param-gather needs --overlap-grad-reduce and the distributed optimizer or
  Megatron-FSDP; Megatron-FSDP needs --ckpt-format fsdp_dtensor.
- tp or cp > 1 needs CUDA_DEVICE_MAX_CONNECTIONS=1 in the environment (on GPUs before
  Blackwell), except with Megatron-FSDP, which refuses that value (tp/cp only warn there).
- Expert parallel needs --num-experts divisible by ep; the expert grid is
  etp * ep * pp * edp = world, and edp divides by the optimizer instances.

Our estimator prices the data-parallel reduction as hidden behind the backward, so the
overlap flags (both off by default in Megatron-LM) are written wherever there is one.
"""

from __future__ import annotations

import shlex

from autotune.config import GIB
from autotune.export import Export, Mapping, Target, comment_block, flag_lines
from autotune.export.megatron_hybrid import hybrid_flags
from autotune.export.megatron_pipeline import pipeline_flags

# Megatron-core's vocab_parallel_cross_entropy at its peak, bytes a logit, the logits included
# (benchmarks/loss_memory.py): from 2-byte logits an fp32 copy kept as the softmax and the
# gradient cast back; fp32 logits are worked on in place.
LOSS_PEAK_BYTES = {2: 6, 4: 4}


def loss_bytes(t: Target) -> tuple[float, float]:
    """(Megatron-LM's cross-entropy, ours: the logits and their gradient) at their peak, bytes a rank."""
    width = 4 if t.model.dtype == "fp32" else 2
    return LOSS_PEAK_BYTES[width] * t.logits, 2 * width * t.logits


def _loss(t: Target) -> Mapping:
    theirs, ours = loss_bytes(t)
    return Mapping("loss (chunked: the logits' gradient beside them)", "approximate" if theirs > ours else "exact", "",
                   f"Megatron-LM's cross-entropy works on an fp32 copy of the logits: {theirs / GIB:.3g} GiB at its "
                   f"peak for the {t.logits:,.0f} logits of a micro-batch here, ours {ours / GIB:.3g} GiB "
                   f"({max(theirs - ours, 0) / GIB:.3g} GiB more than the estimator prices); its native fusion "
                   "(--cross-entropy-loss-fusion) holds more on the CPU, 10 bytes a logit, and is not written")


def uses_megatron_fsdp(t: Target) -> bool:
    return t.layout.dp > 1 and t.layout.zero >= 2


def megatron(t: Target) -> Export:
    L, m, args, maps = t.layout, t.model, [], []

    def add(ours: str, status: str, flags: list[str], note: str = "") -> None:
        args.extend(flags)
        maps.append(Mapping(ours, status, " ".join(flags), note))

    if m.hybrid_pattern is not None and (why_not := hybrid_flags(t, add)):
        return Export("Megatron-LM", "megatron_args.sh", None, maps, reason=why_not)
    add(f"tp={L.tp}", "exact", ["--tensor-model-parallel-size", str(L.tp)])
    if L.tp > 1:
        add(f"sp={L.sp}", "exact", ["--sequence-parallel"] if L.sp else [],
            "" if L.sp else "Megatron-LM leaves sequence parallel off unless --sequence-parallel is given")
    add(f"pp={L.pp}", "exact", ["--pipeline-model-parallel-size", str(L.pp)])
    if L.pp > 1 and (why_not := pipeline_flags(t, add)):
        return Export("Megatron-LM", "megatron_args.sh", None, maps, reason=why_not)
    add(f"cp={L.cp}", "exact", ["--context-parallel-size", str(L.cp)],
        "ring attention with causal load balancing, as ours" if L.cp > 1 else "")
    if m.moe is not None:
        _experts(t, add)
    _data_parallel(t, add)
    add(f"mbs={L.mbs}, grad_accum={t.grad_accum}", "exact",
        ["--micro-batch-size", str(L.mbs), "--global-batch-size", str(m.global_batch_size),
         "--seq-length", str(m.seq_len)],
        f"Megatron-LM derives {t.grad_accum} micro-batches = global batch / (mbs * dp)")
    _recompute(t, add)
    if m.dtype == "bf16":
        add("dtype=bf16", "exact", ["--bf16"], "bf16 weights and compute on fp32 master weights, as ours")
        if m.grad_dtype == "bf16":
            add("grad_dtype=bf16", "exact", ["--grad-reduce-in-bf16"],
                "gradients accumulated and reduced in bf16, the optimizer stepping on fp32 copies, as ours")
        else:
            add("grad_dtype=fp32", "exact", [], "Megatron-LM accumulates and reduces bf16 models' gradients in fp32")
    elif m.dtype == "fp32":
        add("dtype=fp32", "exact", [], "Megatron-LM trains in fp32 unless --bf16 or --fp16 is given")
    else:
        add(f"dtype={m.dtype}", "none", [], "not translated: set Megatron-LM's precision flags for it by hand")
    maps.append(_loss(t))
    env, env_note = _environment(t)
    maps.append(Mapping("environment", "exact", env, env_note))
    theirs, ours = loss_bytes(t)
    beyond = [("the loss's fp32 copy of the logits", theirs - ours)] if theirs > ours else []
    return Export("Megatron-LM", "megatron_args.sh", script(t, maps, args, env), maps, args=args, beyond_ours=beyond)


def _experts(t: Target, add) -> None:
    """The MoE flags: the expert count, EP, whole experts, the all-to-all dispatcher."""
    L, moe = t.layout, t.model.moe
    add(f"experts={moe.num_experts}, top_k={moe.top_k}", "exact",
        ["--num-experts", str(moe.num_experts), "--moe-router-topk", str(moe.top_k)],
        "the model's own; Megatron-LM needs them for expert parallel")
    add("experts whole on each rank", "exact", ["--expert-tensor-parallel-size", "1"],
        "ours never splits an expert over TP; Megatron-LM's default expert TP size is the TP size")
    if L.ep > 1:
        add(f"ep={L.ep}", "approximate", ["--expert-model-parallel-size", str(L.ep)],
            f"the same {moe.num_experts // L.ep} experts per rank; Megatron-LM's expert layers see the "
            f"tp*cp*dp = {L.tp * L.cp * L.dp} ranks of a pipeline stage as ep x expert-dp (tp innermost), "
            "ours carves EP from dp_shard x cp, so the all-to-all groups differ where tp > 1")
        add("dispatch: all-to-all, grouped expert matmul", "exact",
            ["--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"],
            "as ours (Megatron-LM's defaults: allgather dispatcher, one matmul per expert)")


def _data_parallel(t: Target, add) -> None:
    L = t.layout
    dp_note = f"Megatron-LM derives dp = GPUs / (tp*pp*cp) = {L.dp} on {t.gpus} GPUs"
    if L.zero == 0 or L.dp == 1:
        add(f"dp={L.dp}, zero=0", "exact", [], dp_note + "; plain data parallel")
    elif L.zero == 1:
        add(f"dp={L.dp}, zero=1", "exact", ["--use-distributed-optimizer"],
            dp_note + "; the distributed optimizer shards optimizer state over the data-parallel ranks")
    else:
        strategy = "optim_grads" if L.zero == 2 else "optim_grads_params"
        add(f"dp={L.dp}, zero={L.zero}", "exact",
            ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy, "--no-gradient-accumulation-fusion",
             "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"],
            dp_note + f"; Megatron-FSDP's {strategy} shards what zero={L.zero} shards")
    if L.dp > 1 and L.dp_shard < L.dp:
        add(f"dp_shard={L.dp_shard} (HSDP: {L.dp_replicate} replicas)", "exact",
            ["--num-distributed-optimizer-instances", str(L.dp_replicate)],
            f"state sharded over {L.dp_shard} ranks, replicated {L.dp_replicate} times"
            + ("; Megatron-FSDP's hybrid sharding switch" if L.zero >= 2 else ""))
    if L.dp * L.cp > 1:
        sharded = L.zero >= 1 and L.dp > 1
        add("gradient reduction hidden behind the backward", "exact",
            ["--overlap-grad-reduce"] + (["--overlap-param-gather"] if sharded else []),
            "as the estimator prices it; both are off by default in Megatron-LM"
            + ("; the parameter all-gather overlaps the forward" if sharded else ""))


def _recompute(t: Target, add) -> None:
    L = t.layout
    if L.recompute == "selective":
        add("recompute=selective", "exact", ["--recompute-granularity", "selective"],
            "both recompute the attention core (Megatron-LM's default module, core_attn)")
    elif L.recompute == "op":
        add("recompute=op", "approximate", ["--recompute-granularity", "selective", "--recompute-modules",
                                            "layernorm"],
            "ours recomputes the cheap element-wise ops (norms, RoPE, activations); Megatron-LM's nearest module "
            "list recomputes the norms")
    elif L.recompute == "full" and L.recompute_layers:
        add(f"recompute=full, recompute_layers={L.recompute_layers}", "exact",
            ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
             str(L.recompute_layers)], "the first K layers of each pipeline stage, from their inputs")
    elif L.recompute == "full":
        add("recompute=full", "exact", ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                        "--recompute-num-layers", "1"], "every layer recomputed from its input")
    else:
        add("recompute=none", "exact", [])


def _environment(t: Target) -> tuple[str, str]:
    """The CUDA_DEVICE_MAX_CONNECTIONS line and its note."""
    L = t.layout
    if uses_megatron_fsdp(t):
        return ("unset CUDA_DEVICE_MAX_CONNECTIONS",
                "Megatron-FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1 (it only warns about TP or CP with it)")
    if L.tp > 1 or L.cp > 1:
        return ("export CUDA_DEVICE_MAX_CONNECTIONS=1",
                "Megatron-LM asserts it with tp or cp > 1 (before Blackwell): its TP/CP communication must be "
                "queued before the compute that waits for it")
    return "", "nothing needed (tp = cp = 1)"


def script(t: Target, maps: list[Mapping], args: list[str], env: str) -> str:
    L = t.layout
    lines = [f"# Megatron-LM arguments for the layout: {L.short()}",
             f"# Run on {t.gpus} GPUs; source this file, then pass the array to pretrain_gpt.py (or your entry",
             "# point) with your model and data arguments:",
             "#   source megatron_args.sh && torchrun ... pretrain_gpt.py \"${MEGATRON_PARALLEL_ARGS[@]}\" ...",
             "#", *comment_block(maps), ""]
    if env:
        lines += [env, ""]
    lines += ["MEGATRON_PARALLEL_ARGS=("]
    lines += [f"  {' '.join(map(shlex.quote, pair))}" for pair in flag_lines(args)] + [")"]
    return "\n".join(lines) + "\n"


