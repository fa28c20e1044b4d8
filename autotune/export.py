"""best/: the recommended layout for our runtime and translated for other frameworks.

    layout.txt          the layout string for `autotune trial --layout`, and the command
    model.yaml          the model, so the commands here run as they are
    torchrun.sh         the torchrun command for our runtime
    megatron_args.sh    Megatron-LM arguments
    torchtitan.toml     torchtitan's [parallelism], [training] and [activation_checkpoint]
    deepspeed.json      a DeepSpeed config, where one applies (deepspeed_notes.md says how it maps)
    README.md           what each file holds, and every setting's mapping

No framework has every one of our settings, so each translation lists each setting
as `exact` (the same thing), `approximate` (the nearest there, written) or `none`
(no equivalent, nothing written). Flag and key names follow Megatron-LM's
arguments.py, torchtitan's JobConfig (TOML) and DeepSpeed's config documentation.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from autotune.config import ModelConfig, model_from_dict
from autotune.layout import Layout, parse_layout
from autotune.stage_split import stage_layers
from autotune.trialspec import TrialSpec

TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
                        "zero_bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
FILES = ("README.md", "layout.txt", "model.yaml", "torchrun.sh", "megatron_args.sh", "torchtitan.toml",
         "deepspeed.json", "deepspeed_notes.md")


@dataclass
class Mapping:
    """One of our settings in another framework's terms."""

    ours: str  # e.g. "tp=4"
    status: str  # exact | approximate | none
    theirs: str  # what was written there ("" when none)
    note: str = ""


@dataclass
class Export:
    framework: str
    filename: str
    content: str | None  # None: this framework cannot express the layout (why: `reason`)
    mappings: list[Mapping] = field(default_factory=list)
    reason: str = ""


@dataclass
class Target:
    """Everything a translation needs: the layout, the model, the machine."""

    layout: Layout
    model: ModelConfig
    gpus: int
    gpus_per_node: int

    @property
    def grad_accum(self) -> int:
        return self.layout.grad_accum(self.model)

    @property
    def nodes(self) -> int:
        """The fewest nodes that hold the GPUs with the same count on each (torchrun's requirement)."""
        return next(n for n in range(-(-self.gpus // self.gpus_per_node), self.gpus + 1) if self.gpus % n == 0)

    @property
    def stage_layers(self) -> tuple[range, ...]:
        """Our split: the layers of each of the pp*vpp stages (stage_split.py)."""
        return stage_layers(self.model, self.layout.pp * self.layout.vpp)

    @property
    def even_split(self) -> int | None:
        """Layers per stage where every stage has as many, else None."""
        sizes = {len(span) for span in self.stage_layers}
        return sizes.pop() if len(sizes) == 1 else None


def target(question: dict, layout_text: str) -> Target:
    hardware = question.get("hardware") or {}
    per_node = question.get("gpus_per_node") or hardware.get("gpus_per_node") or question["gpus"]
    return Target(Layout(**parse_layout(layout_text)), model_from_dict(question["model"]), question["gpus"],
                  per_node)


# -- Megatron-LM ------------------------------------------------------------------------------
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
        if L.schedule == "1f1b":
            add("schedule=1f1b", "exact", [], "Megatron-LM's schedule without virtual stages is 1F1B")
        elif L.schedule == "interleaved_1f1b":
            add(f"schedule=interleaved_1f1b, vpp={L.vpp}", "exact", vstage,
                "interleaved 1F1B; newer versions also accept --num-virtual-stages-per-pipeline-rank "
                f"{L.vpp}; older ones want the micro-batch count ({t.grad_accum}) divisible by pp")
        elif L.schedule == "gpipe":
            add("schedule=gpipe", "approximate", [], "no GPipe schedule: 1F1B runs instead (same bubble, "
                                                     "fewer micro-batches' activations in flight)")
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


# -- torchtitan -------------------------------------------------------------------------------
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
        par.update(pipeline_parallel_schedule=TORCHTITAN_SCHEDULES[L.schedule],
                   pipeline_parallel_split_points=split_points, pipeline_parallel_microbatch_size=L.mbs)
        maps.append(Mapping(f"schedule={L.schedule}", "exact",
                            f"pipeline_parallel_schedule = \"{TORCHTITAN_SCHEDULES[L.schedule]}\"",
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


# -- DeepSpeed --------------------------------------------------------------------------------
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


# -- our runtime ----------------------------------------------------------------------------
def trial_spec(q: dict, layout: str) -> TrialSpec:
    """What the study ran for this layout (as the controller builds it)."""
    return TrialSpec(model=q["model"], layout=layout, steps=q.get("steps", 5), warmup=q.get("warmup", 2),
                     seed=q.get("seed", 0), device=q.get("device", "cpu"), memory_budget_gb=q.get("memory_budget_gb"),
                     peak_tflops=q.get("peak_tflops"), hardware=(q.get("hardware") or {}).get("name"))


def trial_command(q: dict, layout: str, model_path: str) -> str:
    """`autotune trial` measuring the layout as the study did (one node: its launcher is local)."""
    spec = trial_spec(q, layout)
    hardware = f" --hardware {spec.hardware}" if spec.hardware else ""
    budget = f" --memory-budget-gb {spec.memory_budget_gb:g}" if spec.memory_budget_gb else ""
    return (f"autotune trial --model {model_path} --gpus {q['gpus']} --device {spec.device}{hardware}{budget} "
            f"--steps {spec.steps} --warmup {spec.warmup} --seed {spec.seed} --layout \"{layout}\"")


def runtime(t: Target, question: dict) -> tuple[str, str]:
    """layout.txt and torchrun.sh."""
    L, q = t.layout, question
    spec = trial_spec(q, str(L))
    trial = trial_command(q, str(L), "model.yaml")
    nodes = t.nodes
    layout_txt = (f"{L}\n# {L.short()}: the layout autotune recommends for {t.model.name} on {t.gpus} GPUs.\n"
                  f"# Measure it again (from this folder"
                  + (", on one node" if nodes == 1 else f"; it spans {nodes} nodes: see torchrun.sh") + "):\n"
                  f"#   {trial}\n")
    launch = [f"torchrun --nproc-per-node={t.gpus // nodes}"]
    if nodes == 1:
        launch[0] += " --standalone"
    else:
        launch += [f"--nnodes={nodes} --rdzv-backend=c10d --rdzv-id=autotune",
                   '--rdzv-endpoint="${MASTER_ADDR:?set MASTER_ADDR to the first node}:${MASTER_PORT:-29500}"']
    launch += ["-m autotune.runtime.trial", f"--spec {shlex.quote(spec.to_json())}"]
    where = "on this node" if nodes == 1 else f"on each of the {nodes} nodes (same MASTER_ADDR everywhere)"
    torchrun = "\n".join([
        "#!/usr/bin/env bash",
        f"# The recommended layout ({L.short()}) on autotune's own runtime: {t.gpus} ranks; run this {where}.",
        f"# Every rank runs autotune.runtime.trial: {spec.warmup} warm-up + {spec.steps} measured steps on",
        "# synthetic tokens; rank 0 prints the measurements as one JSON line (AUTOTUNE_RESULT ...).",
        "# Every setting is exact here: it is the runtime that measured the layout.",
        "set -euo pipefail",
        " \\\n  ".join(launch), ""])
    return layout_txt, torchrun


# -- writing ------------------------------------------------------------------------------------
def comment_block(maps: list[Mapping], prefix: str = "# ") -> list[str]:
    lines = []
    for status, title in (("exact", "Maps exactly"), ("approximate", "Approximately (the nearest is written)"),
                          ("none", "No equivalent here (nothing written)")):
        chosen = [mp for mp in maps if mp.status == status]
        if chosen:
            lines.append(f"{prefix}{title}:")
            lines += [f"{prefix}  {mp.ours}" + (f" -> {mp.theirs}" if mp.theirs else "")
                      + (f"  ({mp.note})" if mp.note else "") for mp in chosen]
    return lines


def exports(question: dict, layout_text: str) -> list[Export]:
    t = target(question, layout_text)
    return [megatron(t), torchtitan(t), deepspeed(t)]


def write_best(folder: Path, question: dict, best) -> list[Path]:
    """Write best/ for the recommended trial (a row of the trial table); returns the files."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in FILES:  # a previous report's files, e.g. a DeepSpeed config that no longer applies
        (folder / name).unlink(missing_ok=True)
    t = target(question, best["layout"])
    layout_txt, torchrun = runtime(t, question)
    written = {"layout.txt": layout_txt, "torchrun.sh": torchrun,
               "model.yaml": yaml.safe_dump(question["model"], sort_keys=False)}
    translations = exports(question, best["layout"])
    for x in translations:
        if x.content is not None:
            written[x.filename] = x.content
    deepspeed_export = translations[-1]
    if deepspeed_export.content is not None:
        written["deepspeed_notes.md"] = ("# deepspeed.json: how it maps\n\nJSON has no comments, so the mapping "
                                         "of deepspeed.json is here.\n\n" + "\n".join(
                                             comment_block(deepspeed_export.mappings, prefix="")) + "\n")
    written["README.md"] = readme(t, best, translations)
    for name, text in written.items():
        (folder / name).write_text(text, encoding="utf-8")
    (folder / "torchrun.sh").chmod(0o755)
    return [folder / name for name in written]


def readme(t: Target, best, translations: list[Export]) -> str:
    L = t.layout
    figures = []
    for key, label, pattern in (("tokens_per_s", "tokens/s", "{:,.0f}"), ("mfu", "MFU", "{:.1%}"),
                                ("step_time_s", "step time (s)", "{:.3g}"), ("peak_mem_gb", "peak GiB", "{:.2f}"),
                                ("exposed_comm_fraction", "exposed comm", "{:.0%}")):
        value = best.get(key)
        if value is not None and value == value:
            figures.append(f"{label} {pattern.format(value)}")
    lines = [f"# The recommended layout: {L.short()}", "",
             f"{t.model.name} on {t.gpus} GPUs, trial {int(best['trial'])}: {', '.join(figures)}.", "",
             f"    {L}", "",
             "| file | what |", "|---|---|",
             "| layout.txt | the layout string for `autotune trial --layout`, and the command |",
             "| model.yaml | the model, so the commands here run as they are |",
             "| torchrun.sh | the torchrun command for autotune's runtime (every setting exact) |"]
    for x in translations:
        lines.append(f"| {x.filename} | " + (f"{x.framework} settings |" if x.content is not None else
                                             f"not written: {x.reason} |"))
        if x.framework == "DeepSpeed" and x.content is not None:
            lines.append("| deepspeed_notes.md | how deepspeed.json maps (JSON has no comments) |")
    for x in translations:
        lines += ["", f"## {x.framework} ({x.filename})", ""]
        if x.content is None:
            lines.append(f"Not written: {x.reason}.")
            continue
        lines += ["| ours | mapping | there | note |", "|---|---|---|---|"]
        lines += [f"| `{mp.ours}` | {mp.status} | {('`' + mp.theirs + '`') if mp.theirs else '-'} | {mp.note} |"
                  for mp in x.mappings]
    return "\n".join(lines) + "\n"
