"""The arithmetic Megatron-LM's argument validation applies, to check our exports against.

Megatron-LM's training arguments are not on the package index, so its parse_args and
validate_args cannot run here. These are its rules, read from
megatron/training/arguments.py (validate_args), megatron/core/transformer/
transformer_config.py (the pipeline split), pipeline_parallel_layer_layout.py (the
layout string), parallel_state.py (the expert grid) and pipeline_parallel/schedules.py
(the interleaved schedule's micro-batch groups) of Megatron-LM main; each `check_*`
raises AssertionError with the rule it breaks. `FLAGS` is every flag an export may
write, with whether it takes a value, as that parser defines it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# flag -> takes a value (False: a store_true switch)
FLAGS = {
    "--tensor-model-parallel-size": True, "--sequence-parallel": False, "--pipeline-model-parallel-size": True,
    "--pipeline-model-parallel-layout": True, "--num-virtual-stages-per-pipeline-rank": True,
    "--num-layers-per-virtual-pipeline-stage": True, "--decoder-first-pipeline-num-layers": True,
    "--decoder-last-pipeline-num-layers": True, "--microbatch-group-size-per-virtual-pipeline-stage": True,
    "--context-parallel-size": True, "--expert-model-parallel-size": True, "--expert-tensor-parallel-size": True,
    "--num-experts": True, "--moe-router-topk": True, "--moe-token-dispatcher-type": True,
    "--moe-grouped-gemm": False, "--use-distributed-optimizer": False, "--use-megatron-fsdp": False,
    "--data-parallel-sharding-strategy": True, "--no-gradient-accumulation-fusion": False, "--ckpt-format": True,
    "--num-distributed-optimizer-instances": True, "--overlap-grad-reduce": False, "--overlap-param-gather": False,
    "--micro-batch-size": True, "--global-batch-size": True, "--seq-length": True,
    "--recompute-granularity": True, "--recompute-method": True, "--recompute-num-layers": True,
    "--recompute-modules": True, "--bf16": False, "--fp16": False, "--grad-reduce-in-bf16": False,
    "--hybrid-layer-pattern": True, "--hybrid-override-pattern": True, "--mamba-state-dim": True,
    "--mamba-head-dim": True, "--mamba-num-groups": True, "--mamba-num-heads": True,
}
# megatron/core/models/hybrid/hybrid_layer_allocation.py's layer symbols: Mamba, attention, MLP,
# MoE, gated DeltaNet, DeepSeek sparse attention.
HYBRID_SYMBOLS = set("M*-EGD")
CHOICES = {"--moe-token-dispatcher-type": {"allgather", "alltoall", "flex"},
           "--data-parallel-sharding-strategy": {"no_shard", "optim", "optim_grads", "optim_grads_params"},
           "--ckpt-format": {"torch", "torch_dist", "torch_dcp", "fsdp_dtensor"},
           "--recompute-granularity": {"full", "selective"}, "--recompute-method": {"uniform", "block"},
           "--recompute-modules": {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                                   "shared_experts"}}


@dataclass
class Args:
    """Parsed flags with Megatron-LM's defaults."""

    values: dict = field(default_factory=dict)

    def get(self, flag: str, default=None):
        return self.values.get(flag, default)

    def int(self, flag: str, default: int | None = None) -> int | None:
        value = self.values.get(flag)
        return default if value is None else int(value)

    def on(self, flag: str) -> bool:
        return self.values.get(flag) is True


def parse(argv: list[str]) -> Args:
    """Like argparse over FLAGS: unknown flags, missing values and repeats are errors."""
    values, i = {}, 0
    while i < len(argv):
        flag = argv[i]
        assert flag in FLAGS, f"unrecognized argument {flag}"
        assert flag not in values, f"{flag} given twice"
        if not FLAGS[flag]:
            values[flag], i = True, i + 1
            continue
        taken = []
        i += 1
        while i < len(argv) and not argv[i].startswith("--"):
            taken.append(argv[i])
            i += 1
        assert taken, f"{flag}: expected a value"
        assert flag == "--recompute-modules" or len(taken) == 1, f"{flag}: one value, got {taken}"
        for value in taken:
            assert flag not in CHOICES or value in CHOICES[flag], f"{flag}: invalid choice {value!r}"
        values[flag] = taken if flag == "--recompute-modules" else taken[0]
    return Args(values)


def layout_stages(text: str) -> list[list[str]]:
    """A layout string as stages of layer letters: commas dropped, (..)*n and x*n unrolled."""
    text = text.replace(",", "")
    while (match := re.search(r"\(([^()]*)\)\*(\d+)", text)):
        text = text[:match.start()] + match.group(1) * int(match.group(2)) + text[match.end():]
    text = re.sub(r"(.)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
    stages = [list(stage) for stage in text.split("|")]
    for stage in stages:
        assert set(stage) <= set("ELtm"), f"layout: unknown layer letter in {''.join(stage)!r}"
    return stages


def check(argv: list[str], env: dict, world: int, num_layers: int, grad_accum_expected: int | None = None,
          gpu_arch: int = 9) -> Args:
    """Every rule below, for a training run of `world` GPUs; returns the parsed arguments."""
    a = parse(argv)
    tp, pp, cp = a.int("--tensor-model-parallel-size", 1), a.int("--pipeline-model-parallel-size", 1), \
        a.int("--context-parallel-size", 1)
    assert world % (tp * pp * cp) == 0, f"world size ({world}) is not divisible by tp*pp*cp ({tp * pp * cp})"
    dp = world // (tp * pp * cp)
    mbs, gbs = a.int("--micro-batch-size"), a.int("--global-batch-size")
    assert mbs and mbs > 0 and gbs and gbs > 0
    assert gbs % (mbs * dp) == 0, f"global batch {gbs} must divide by mbs*dp = {mbs}*{dp}"
    m = gbs // (mbs * dp)
    if grad_accum_expected is not None:
        assert m == grad_accum_expected, f"Megatron derives {m} micro-batches, ours {grad_accum_expected}"
    assert not a.on("--grad-reduce-in-bf16") or a.on("--bf16"), "--grad-reduce-in-bf16 acts only with --bf16"
    seq = a.int("--seq-length")
    if cp > 1:
        assert seq % (2 * cp) == 0, "seq-length should be a multiple of 2 * context-parallel-size"
    vpp = check_pipeline(a, pp, num_layers)
    check_schedule(a, pp, vpp, m)
    check_data_parallel(a, env, tp, cp, dp, gpu_arch)
    check_experts(a, world, tp, pp, cp, dp)
    check_recompute(a, tp, pp, num_layers)
    check_hybrid(a, tp, num_layers)
    assert not (a.on("--bf16") and a.on("--fp16")), "--bf16 and --fp16 together"
    return a


def check_hybrid(a: Args, tp: int, num_layers: int) -> None:
    """The hybrid model's pattern (TransformerConfig's derivation of num_layers from it) and the
    Mamba mixer's tensor-parallel asserts (megatron/core/ssm/mamba_mixer.py)."""
    new, old = a.get("--hybrid-layer-pattern"), a.get("--hybrid-override-pattern")
    assert not (new and old), "hybrid_override_pattern and hybrid_layer_pattern cannot both be specified"
    pattern = new or old
    if pattern is None:
        assert not any(a.get(f) for f in ("--mamba-num-heads", "--mamba-num-groups")), \
            "Mamba sizes without a hybrid layer pattern"
        return
    assert set(pattern) <= HYBRID_SYMBOLS, f"unknown symbols in the hybrid pattern {pattern!r}"
    assert len(pattern) == num_layers, \
        f"num_layers ({num_layers}) does not match the number of layers derived from the pattern ({len(pattern)})"
    heads, groups = a.int("--mamba-num-heads"), a.int("--mamba-num-groups", 8)
    if "M" in pattern:
        assert heads is not None, "--mamba-num-heads: the inner width must be given as heads"
        assert heads % tp == 0, "nheads must be evenly divisible by tp"
        assert groups % tp == 0, "ngroups must be evenly divisible by tp"


def check_pipeline(a: Args, pp: int, num_layers: int) -> int | None:
    """The split's rules; returns the virtual stages per rank (None without)."""
    ways = [f for f in ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                        "--pipeline-model-parallel-layout") if a.get(f) is not None]
    assert len(ways) <= 1, f"no more than one of {ways} may be set"
    first, last = a.int("--decoder-first-pipeline-num-layers"), a.int("--decoder-last-pipeline-num-layers")
    vpp = None
    if a.get("--pipeline-model-parallel-layout") is not None:
        assert first is None and last is None, "the layout cannot be set with other pipeline layout arguments"
        stages = layout_stages(a.get("--pipeline-model-parallel-layout"))
        assert len(stages) % pp == 0, f"the layout's {len(stages)} stages must divide by pp ({pp})"
        flat = [letter for stage in stages for letter in stage]
        assert flat and flat[0] == "E" and flat[-1] == "L", "the first layer must be E and the last L"
        assert flat.count("E") == 1 and flat.count("L") == 1, "E and L exactly once each"
        assert flat.count("t") == num_layers, f"decoder layers {flat.count('t')} must match num_layers {num_layers}"
        assert all(stage.count("t") for stage in stages), "every stage of ours holds a decoder layer"
        vpp = len(stages) // pp if len(stages) > pp else None
    elif ways:
        if a.get("--num-virtual-stages-per-pipeline-rank") is not None:
            vpp = a.int("--num-virtual-stages-per-pipeline-rank")
        else:
            assert first is None and last is None, "uneven PP with virtual stages needs --num-virtual-stages-..."
            assert num_layers % pp == 0
            per_rank = num_layers // pp
            assert per_rank % a.int("--num-layers-per-virtual-pipeline-stage") == 0
            vpp = per_rank // a.int("--num-layers-per-virtual-pipeline-stage")
        vpp = vpp if vpp and vpp > 1 else None
    if a.get("--pipeline-model-parallel-layout") is None:
        check_uneven(first, last, pp, num_layers, vpp)
    if vpp is not None:
        assert pp > 1, "interleaved schedule needs pp > 1 (overlapping p2p is on by default)"
    return vpp


def check_uneven(first: int | None, last: int | None, pp: int, num_layers: int, vpp: int | None) -> None:
    """TransformerConfig's uneven split: first/last count per pipeline rank, over its virtual stages."""
    rest, ranks = num_layers, pp
    for name, count in (("first", first), ("last", last)):
        if count is None:
            continue
        assert count > 0, f"num_layers_in_{name}_pipeline_stage must be larger than 0"
        assert vpp is None or count % vpp == 0, \
            f"number of layers at {name} stage: {count} must be divisible by virtual pipeline parallel degree {vpp}"
        rest, ranks = rest - count, ranks - 1
    if first is None and last is None:
        assert num_layers % (pp * (vpp or 1)) == 0, "layers must divide evenly by the (virtual) stages"
        return
    assert bool(rest) == bool(ranks), f"{rest} middle layers but {ranks} middle stages"
    if ranks:
        assert rest % ranks == 0, f"middle layers {rest} must divide by the middle stages {ranks}"
        assert vpp is None or (rest // ranks) % vpp == 0, "middle rank's layers must divide by vpp"


def check_schedule(a: Args, pp: int, vpp: int | None, m: int) -> None:
    """The interleaved schedule's micro-batch groups (a runtime check, made at the first step)."""
    group = a.int("--microbatch-group-size-per-virtual-pipeline-stage")
    if vpp is None:
        return
    group = group or pp
    assert pp <= group <= m, f"the micro-batch group ({group}) must range in [pp={pp}, m={m}]"
    assert m % group == 0 or m % group >= pp, f"m % group ({m % group}) must be 0 or at least pp ({pp})"


def check_data_parallel(a: Args, env: dict, tp: int, cp: int, dp: int, gpu_arch: int) -> None:
    fsdp = a.on("--use-megatron-fsdp")
    if a.on("--overlap-param-gather"):
        assert a.on("--use-distributed-optimizer") or fsdp, \
            "--overlap-param-gather only with the distributed optimizer or Megatron-FSDP"
        assert a.on("--overlap-grad-reduce"), "--overlap-param-gather needs --overlap-grad-reduce"
    if fsdp:
        assert env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1", "FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset"
        assert a.get("--ckpt-format") == "fsdp_dtensor", "Megatron-FSDP requires --ckpt-format fsdp_dtensor"
    elif (tp > 1 or cp > 1) and gpu_arch < 10:
        assert env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1", "tp or cp > 1 needs CUDA_DEVICE_MAX_CONNECTIONS=1"
    if a.get("--ckpt-format") == "fsdp_dtensor":
        assert fsdp, "--ckpt-format fsdp_dtensor is only with Megatron-FSDP"
    instances = a.int("--num-distributed-optimizer-instances", 1)
    assert (dp * cp) % instances == 0, "data parallel size should be divisible by the optimizer instances"


def check_experts(a: Args, world: int, tp: int, pp: int, cp: int, dp: int) -> None:
    ep, experts = a.int("--expert-model-parallel-size", 1), a.int("--num-experts")
    etp = a.int("--expert-tensor-parallel-size", tp)
    if ep > 1:
        assert experts is not None, "num_experts must be non None to use expert model parallelism"
        assert experts % ep == 0, "Number of experts should be a multiple of expert model parallel_size"
    assert world % (etp * ep * pp) == 0, f"world ({world}) not divisible by etp*ep*pp ({etp}*{ep}*{pp})"
    edp = world // (etp * ep * pp)
    assert edp % a.int("--num-distributed-optimizer-instances", 1) == 0, \
        "Expert data parallel size should be divisible by the optimizer instances"
    if a.on("--moe-grouped-gemm") or a.get("--moe-token-dispatcher-type"):
        assert experts is not None, "MoE flags without --num-experts"


def check_recompute(a: Args, tp: int, pp: int, num_layers: int) -> None:
    granularity, method = a.get("--recompute-granularity"), a.get("--recompute-method")
    count = a.int("--recompute-num-layers")
    if granularity == "selective":
        assert method is None, "recompute method is not supported for selective granularity"
        assert count is None, "selective recompute: recompute_num_layers must be None"
        modules = a.get("--recompute-modules") or []
        assert "moe_act" not in modules or a.on("--moe-grouped-gemm"), "moe_act needs --moe-grouped-gemm"
    elif granularity == "full":
        assert method in ("uniform", "block"), "full recompute needs --recompute-method uniform or block"
        assert count is not None and 1 <= count <= num_layers // pp, \
            f"recompute_num_layers must be between 1 and layers per pipeline rank ({num_layers // pp})"
    else:
        assert method is None and count is None and a.get("--recompute-modules") is None
