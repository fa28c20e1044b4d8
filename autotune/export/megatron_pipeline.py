"""Our pipeline (stage split, schedule, micro-batch rounds) in Megatron-LM's flags.

Megatron-LM places virtual stage s on pipeline rank s % pp (looped, as torch's
interleaved schedules do) and has two schedules: 1F1B, and interleaved 1F1B when a
rank holds several stages. Its even split gives every stage num_layers / (pp*vpp)
layers; `--decoder-first/last-pipeline-num-layers` count per pipeline rank over all
its virtual stages and must divide by vpp, so they cannot say "7 layers in the first
virtual stage". `--pipeline-model-parallel-layout` names every stage's layers
("E" the embedding, "t" a decoder layer, "L" the loss with the head, "|" between
stages, in stage order), so it holds any split of ours exactly and sets the virtual
stage count from the number of stages.

Megatron's interleaved schedule runs micro-batches in groups of N per virtual stage
(`--microbatch-group-size-per-virtual-pipeline-stage`, default pp) and refuses unless
pp <= N <= m and m % N is 0 or at least pp (m: micro-batches per step). torch runs
rounds of m // max(1, m // pp), so that is the N written where it differs from pp.
"""

from __future__ import annotations

from autotune.export import Target
from autotune.plan.schedules import SCHEDULES


def layout_string(sizes: list[int]) -> str:
    """Megatron-LM's layout for stages of these many decoder layers, in stage order."""
    parts = [f"t*{n}" for n in sizes]
    parts[0] = "E" + parts[0]
    parts[-1] = parts[-1] + "L"
    return "|".join(parts)


def microbatch_group(pp: int, m: int) -> int | None:
    """N for Megatron-LM's interleaved schedule with m micro-batches, or None where it
    has none (m < pp). Torch's round size where Megatron accepts it, else all m at once."""
    if m < pp:
        return None
    for n in (m // max(1, m // pp), m):
        if pp <= n <= m and (m % n == 0 or m % n >= pp):
            return n
    return None  # unreachable: n = m always passes


def pipeline_flags(t: Target, add) -> str | None:
    """Add the pipeline's flags through `add(ours, status, flags, note)`; returns why
    Megatron-LM cannot run the layout, or None."""
    L = t.layout
    schedule = SCHEDULES[L.schedule]
    sizes = [len(span) for span in t.stage_layers]
    stages = L.pp * L.vpp
    if t.even_split and L.vpp == 1:
        add(f"stages {sizes}", "exact", [], f"Megatron-LM's even split: {t.even_split} layers per stage")
    elif t.even_split:
        add(f"vpp={L.vpp}, stages {sizes}", "exact", ["--num-virtual-stages-per-pipeline-rank", str(L.vpp)],
            f"Megatron-LM's even split: {t.even_split} layers in each of the {stages} virtual stages")
    else:
        add(f"vpp={L.vpp}, stages {sizes}", "exact", ["--pipeline-model-parallel-layout", layout_string(sizes)],
            f"every stage's layers named, embedding (E) in the first, loss and head (L) in the last; "
            f"{stages} stages on {L.pp} ranks" + (f" = {L.vpp} virtual stages per rank" if L.vpp > 1 else ""))
    if L.vpp == 1:
        status = "exact" if schedule.megatron_exact else "approximate"
        add(f"schedule={L.schedule}", status, [],
            "Megatron-LM runs 1F1B without virtual stages" if status == "exact" else
            f"Megatron-LM has no {L.schedule}: 1F1B runs (the same bubble, at most pp micro-batches in flight)")
        return None
    m = t.grad_accum
    group = microbatch_group(L.pp, m)
    if group is None:
        return (f"Megatron-LM's interleaved schedule needs at least pp ({L.pp}) micro-batches per step, "
                f"this layout has grad_accum = {m}")
    flags = [] if group == L.pp else ["--microbatch-group-size-per-virtual-pipeline-stage", str(group)]
    if schedule.megatron_exact:
        add(f"schedule={L.schedule}", "exact", flags,
            f"interleaved 1F1B over the virtual stages, in rounds of {group} micro-batches as torch's")
    else:
        placement = (" and places virtual stage s on rank s % pp, where ours puts a rank's two stages in a V "
                     "(rank r holds stages r and 2*pp-1-r)") if schedule.v_shape else ""
        add(f"schedule={L.schedule}", "approximate", flags,
            f"Megatron-LM has no {L.schedule}: it runs interleaved 1F1B over the same {stages} stages "
            f"(rounds of {group} micro-batches){placement}")
    return None
