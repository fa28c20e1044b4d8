"""Megatron-LM arguments for a layout (flag names of Megatron-LM's arguments.py)."""

from __future__ import annotations

from autotune.export import Export, Mapping, Target, comment_block
from autotune.schedules import SCHEDULES


def _megatron_split(t: Target, add) -> list[str]:
    """Our stage split in Megatron-LM's flags; returns the virtual-stage flags the
    schedule mapping writes."""
    L, sizes = t.layout, [len(span) for span in t.stage_layers]
    if t.even_split:
        return ["--num-layers-per-virtual-pipeline-stage", str(t.even_split)] if L.vpp > 1 else []
    first, middle, last = sizes[0], sizes[1:-1], sizes[-1]
    flags = ["--decoder-first-pipeline-num-layers", str(first), "--decoder-last-pipeline-num-layers", str(last)]
    even_middle = len(set(middle)) <= 1
    add(f"stage split {sizes}", "exact" if even_middle and L.vpp == 1 else "approximate", flags,
        "ours weighs the embedding and the head as layers; Megatron-LM splits the layers between the first "
        "and the last stage evenly" + ("" if even_middle else f", where ours gives {middle}")
        + ("" if L.vpp == 1 else "; check how your version applies these to virtual stages"))
    return ["--num-virtual-stages-per-pipeline-rank", str(L.vpp)] if L.vpp > 1 else []


def megatron(t: Target) -> Export:
    L, m, args, maps = t.layout, t.model, [], []

    def add(ours: str, status: str, flags: list[str], note: str = "") -> None:
        args.extend(flags)
        maps.append(Mapping(ours, status, " ".join(flags), note))

    add(f"tp={L.tp}", "exact", ["--tensor-model-parallel-size", str(L.tp)])
    if L.tp > 1:
        add(f"sp={L.sp}", "exact", ["--sequence-parallel"] if L.sp else [],
            "" if L.sp else "Megatron-LM leaves sequence parallel off unless --sequence-parallel is given")
    add(f"pp={L.pp}", "exact", ["--pipeline-model-parallel-size", str(L.pp)])
    if L.pp > 1:
        vstage = _megatron_split(t, add)
        schedule = SCHEDULES[L.schedule]
        if schedule.megatron_exact and not schedule.multi_stage:
            add(f"schedule={L.schedule}", "exact", [], "Megatron-LM's schedule without virtual stages is 1F1B")
        elif schedule.megatron_exact:
            add(f"schedule={L.schedule}, vpp={L.vpp}", "exact", vstage,
                "interleaved 1F1B; newer versions also accept --num-virtual-stages-per-pipeline-rank "
                f"{L.vpp}; older ones want the micro-batch count ({t.grad_accum}) divisible by pp")
        elif not schedule.multi_stage:
            add(f"schedule={L.schedule}", "approximate", [], f"no {L.schedule} schedule: 1F1B runs instead (same "
                                                            f"bubble, fewer micro-batches' activations in flight)")
        else:
            add(f"schedule={L.schedule}, vpp={L.vpp}", "approximate", vstage if L.vpp > 1 else [],
                f"no {L.schedule} schedule in Megatron-LM: the nearest, interleaved 1F1B with the same "
                f"virtual stages, is written" if L.vpp > 1 else f"no {L.schedule} schedule: 1F1B runs instead")
    add(f"cp={L.cp}", "exact", ["--context-parallel-size", str(L.cp)],
        "ring attention with causal load balancing, as ours" if L.cp > 1 else "")
    if L.ep > 1:
        add(f"ep={L.ep}", "approximate", ["--expert-model-parallel-size", str(L.ep)],
            "Megatron-LM forms expert groups over data x context parallel ranks and splits each expert over "
            "--expert-tensor-parallel-size (default: the TP size); ours carves EP from dp_shard x cp")
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
            dp_note + f"; Megatron-FSDP's {strategy} shards what zero={L.zero} shards"
            + ("; check that your version combines Megatron-FSDP with pipeline parallel" if L.pp > 1 else ""))
    if L.dp > 1 and L.dp_shard < L.dp:
        add(f"dp_shard={L.dp_shard} (HSDP: {L.dp_replicate} replicas)", "exact" if L.zero == 1 else "approximate",
            ["--num-distributed-optimizer-instances", str(L.dp_replicate)],
            "copies of the distributed optimizer across the data-parallel ranks"
            + ("" if L.zero == 1 else "; with Megatron-FSDP check how your version spells hybrid sharding"))
    add(f"mbs={L.mbs}, grad_accum={t.grad_accum}", "exact",
        ["--micro-batch-size", str(L.mbs), "--global-batch-size", str(m.global_batch_size),
         "--seq-length", str(m.seq_len)],
        f"Megatron-LM derives {t.grad_accum} micro-batches = global batch / (mbs * dp)")
    if L.recompute == "selective":
        add("recompute=selective", "exact", ["--recompute-granularity", "selective"],
            "both recompute the attention core only")
    elif L.recompute == "full":
        add("recompute=full", "exact", ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                        "--recompute-num-layers", "1"], "every layer recomputed from its input")
    else:
        add("recompute=none", "exact", [])
    if m.dtype == "bf16":
        add("dtype=bf16", "exact", ["--bf16"])
    lines = [f"# Megatron-LM arguments for the layout autotune recommends: {L.short()}",
             f"# Run on {t.gpus} GPUs; pass them to pretrain_gpt.py (or your entry point) with your model",
             "# and data arguments:  torchrun ... pretrain_gpt.py \"${MEGATRON_PARALLEL_ARGS[@]}\" ...",
             "#", *comment_block(maps), "", "MEGATRON_PARALLEL_ARGS=("]
    lines += [f"  {' '.join(pair)}" for pair in flag_lines(args)] + [")"]
    return Export("Megatron-LM", "megatron_args.sh", "\n".join(lines) + "\n", maps)


def flag_lines(args: list[str]) -> list[list[str]]:
    """Group a flat argument list into one line per flag with its values."""
    lines: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not lines:
            lines.append([arg])
        else:
            lines[-1].append(arg)
    return lines
