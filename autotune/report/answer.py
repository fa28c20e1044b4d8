"""The answer of a study: which layout to train with, why it won, what the runner-up costs.

The "why" is told in the practitioners' terms (tensor parallel inside a node, the
pipeline bubble, the communication share, memory headroom, recompute), each rule
checked against this study's measurements, so the reader sees which rule of thumb
the result confirms and which it breaks. Only rules the data speaks to are listed.
Plain text throughout: the HTML escapes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from autotune.plan.schedules import SCHEDULES
from autotune.record import COMPLETE, Question
from autotune.report.table import LAYOUT_COLUMNS
from autotune.report.table import ranked as ranked_trials

# Rules of thumb, as practitioners state them.
HEADROOM_WANTED = 0.20  # keep 20-30% of device memory free for buffers and fragmentation
MICRO_BATCHES_PER_STAGE = 4  # want micro-batches >= 4 x PP
LONG_SEQUENCE = 16384  # context parallel pays off from tens of thousands of tokens
TIED = 0.02  # two layouts within 2% are a tie on a few measured steps
SAFER_WITHIN = 0.05  # a runner-up this close that keeps the headroom the winner lacks is worth naming
OBJECTIVE_LABEL = {"tokens_per_s": "tokens/s", "mfu": "MFU"}


@dataclass
class Rule:
    verdict: str  # "confirms", "breaks" or "note"
    title: str
    text: str


@dataclass
class Choice:
    """One value of one layout key across the study: how its best layout fared."""

    key: str
    value: object
    chosen: bool
    trials: int
    best_trial: int | None
    vs_best: float | None  # relative to the recommended layout's objective, e.g. -0.12
    outcomes: str  # "3 complete, 2 pruned/oom"


@dataclass
class Answer:
    objective: str
    best: pd.Series | None
    runner_up: pd.Series | None
    ranked: pd.DataFrame  # complete trials, best first
    rules: list[Rule] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)
    runner_up_text: str = ""
    summary: str = ""


def present(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def objective_text(objective: str, value: float) -> str:
    return f"{value:.1%} MFU" if objective == "mfu" else f"{value:,.0f} tokens/s"


def outcome(row) -> str:
    return row["status"] + (f"/{row['reason']}" if present(row["reason"]) else "")


def answer(question: Question, table: pd.DataFrame) -> Answer:
    objective = question.objective
    ranked = ranked_trials(table)
    best = ranked.iloc[0] if len(ranked) else None
    runner_up = ranked.iloc[1] if len(ranked) > 1 else None
    result = Answer(objective, best, runner_up, ranked)
    if best is None:
        counts = table.groupby(table.apply(outcome, axis=1)).size() if len(table) else pd.Series(dtype=int)
        told = ", ".join(f"{n} {name}" for name, n in counts.items()) or "no trials"
        result.summary = f"No layout completed ({told}): there is nothing to recommend yet."
        return result
    result.summary = (f"Train with {best['layout_short']}: {objective_text(objective, best['value'])}, the best of "
                      f"{len(ranked)} measured layout{'s' if len(ranked) != 1 else ''} "
                      f"({len(table)} trials in all).")
    result.rules = rules(question, table, best)
    result.choices = choices(table, best)
    result.runner_up_text = runner_up_text(question, best, runner_up, objective)
    return result


def choices(table: pd.DataFrame, best: pd.Series) -> list[Choice]:
    """For every layout key the study varied: each value's best measured layout."""
    out = []
    tried = table[table["layout"].notna()]
    hsdp = (tried["dp_shard"] != tried["dp"]).any()
    for key in LAYOUT_COLUMNS:
        values = list(dict.fromkeys(tried[key]))
        if len(values) < 2 or (key == "dp_shard" and not hsdp):  # dp_shard = dp throughout: dp says it all
            continue
        for value in sorted(values, key=lambda v: (v != best[key], str(v).zfill(8))):
            group = tried[tried[key] == value]
            done = group[group["status"] == COMPLETE]
            top = done.sort_values("value", ascending=False).iloc[0] if len(done) else None
            counts = group.groupby(group.apply(outcome, axis=1)).size().sort_values(ascending=False)
            out.append(Choice(
                key=key, value=value, chosen=value == best[key], trials=len(group),
                best_trial=int(top["trial"]) if top is not None else None,
                vs_best=float(top["value"] / best["value"] - 1) if top is not None and best["value"] else None,
                outcomes=", ".join(f"{n} {name}" for name, n in counts.items())))
    return out


def rules(question: Question, table: pd.DataFrame, best: pd.Series) -> list[Rule]:
    model = question.model
    per_node = question.scale_up  # "a node" in these rules: the scale-up domain (NVL72: 72 GPUs)
    gpus = question.gpus
    out = []
    tp, pp, cp, ep, dp = (int(best[k]) for k in ("tp", "pp", "cp", "ep", "dp"))

    # Communication volume, largest first: TP > EP > CP > PP > DP; the costliest inside a node.
    if tp > 1 and per_node:
        nodes = f"{gpus // per_node} domains" if gpus and gpus > per_node else "one domain"
        out.append(Rule("confirms", "Tensor parallel inside a node",
                        f"TP={tp} within a scale-up domain of {per_node} GPUs ({nodes} in all): TP's "
                        f"all-reduces, the largest communication volume, stay on NVLink / Infinity Fabric."))
    if ep > 1 and per_node:
        span = ep * tp  # mesh (pp, dp_replicate, dp_shard, cp, tp): EP ranks sit tp apart
        inside = span <= per_node
        out.append(Rule("confirms" if inside else "breaks", "Expert all-to-all inside a node",
                        f"EP={ep}: an expert group spans about {span} consecutive ranks, "
                        + ("inside a scale-up domain of %d GPUs, as practitioners prefer." % per_node if inside
                           else "more than a scale-up domain of %d GPUs: the all-to-all crosses the scale-out "
                           "network, and still this layout measured fastest." % per_node)))

    # The pipeline bubble: (p-1)/(m+p-1) for GPipe and 1F1B; interleaving divides it by vpp.
    if pp > 1 and present(best["grad_accum"]):
        m, vpp, schedule = int(best["grad_accum"]), int(best["vpp"]), best["schedule"]
        looped = SCHEDULES[schedule].placement == "looped"
        bubble = (pp - 1) / (m + pp - 1) / (vpp if looped else 1)
        enough = m >= MICRO_BATCHES_PER_STAGE * pp
        text = (f"PP={pp} with {m} micro-batches per step and schedule {schedule}: bubble about "
                f"(p-1)/(m+p-1){'/vpp' if looped else ''} = {bubble:.0%}"
                + (" before the zero-bubble schedule fills it" if SCHEDULES[schedule].split_backward else "")
                + ". "
                + (f"m >= 4 x PP = {4 * pp}: as the rule wants." if enough else
                   f"The rule wants m >= 4 x PP = {4 * pp}; this layout won with fewer."))
        out.append(Rule("confirms" if enough else "breaks", "Pipeline bubble", text))

    # Communication share: > 30% of the step communicating means the layout is cut too finely.
    threshold = question.max_comm_fraction
    exposed, total = best["exposed_comm_fraction"], best["comm_fraction"]
    if present(exposed):
        overlap = (f" {total:.0%} of the step communicates, {max(total - exposed, 0):.0%} of it hidden behind "
                   f"compute." if present(total) else "")
        out.append(Rule("confirms" if exposed <= threshold else "breaks", "Communication share",
                        f"Exposed communication {exposed:.0%} of the step, "
                        f"{'under' if exposed <= threshold else 'over'} the {threshold:.0%} threshold.{overlap}"))

    # Memory: static state plus activations, with 20-30% headroom.
    budget = question.memory_budget_gb
    peak = best["peak_mem_gb"]
    if budget and present(peak):
        headroom = 1 - peak / budget
        ok = headroom >= HEADROOM_WANTED
        out.append(Rule("confirms" if ok else "breaks", "Memory headroom",
                        f"Peak {peak:.1f} GiB of {budget:g} GiB: {headroom:.0%} headroom"
                        + (" (the rule of thumb keeps 20-30% free for buffers and fragmentation)." if ok else
                           ", less than the 20-30% practitioners keep for buffers and fragmentation: "
                           "a longer run may need more.")))
    elif present(peak):
        out.append(Rule("note", "Memory headroom", f"Peak {peak:.2f} GiB; no memory budget was set on this "
                                                   f"device, so headroom is not judged."))

    # Recompute: ~20-30% more compute for most of the activation memory.
    if best["recompute"] != "none":
        twin = table[(table["layout"].notna()) & (table["recompute"] == "none")]
        for key in LAYOUT_COLUMNS:
            if key != "recompute":
                twin = twin[twin[key] == best[key]]
        if len(twin):
            t = twin.iloc[0]
            if t["status"] == COMPLETE:
                text = (f"recompute={best['recompute']} beat the same layout without recompute (trial "
                        f"{t['trial']}) by {best['value'] / t['value'] - 1:.0%}, against the rule of thumb "
                        f"that recompute costs 20-30% more compute.")
                verdict = "breaks"
            else:
                text = (f"recompute={best['recompute']} costs compute, but the same layout without it ended "
                        f"{outcome(t)} (trial {t['trial']}): the memory it saves is what makes this layout run.")
                verdict = "confirms"
        else:
            text = (f"recompute={best['recompute']} trades about 20-30% more compute for activation memory; "
                    f"the same layout without recompute was not tried.")
            verdict = "note"
        out.append(Rule(verdict, "Activation recompute", text))

    # Context parallel: for long sequences.
    seq = model.get("seq_len")
    if cp > 1 and seq:
        long = seq >= LONG_SEQUENCE
        out.append(Rule("confirms" if long else "breaks", "Context parallel for long sequences",
                        f"CP={cp} at seq_len {seq:,}: "
                        + ("a long sequence, where CP pays off." if long else
                           "practitioners keep CP for tens of thousands of tokens; here it measured fastest "
                           "anyway.")))

    # The estimator: how far the prediction was from the measurement.
    if present(best["predicted_tokens_per_s"]) and present(best["tokens_per_s"]) and best["predicted_tokens_per_s"]:
        parts = [f"throughput {best['tokens_per_s'] / best['predicted_tokens_per_s'] - 1:+.0%}"]
        if present(best["predicted_peak_mem_gb"]) and present(peak) and best["predicted_peak_mem_gb"]:
            parts.append(f"peak memory {peak / best['predicted_peak_mem_gb'] - 1:+.0%}")
        out.append(Rule("note", "Measured against predicted",
                        f"Measured relative to the estimator's prediction: {', '.join(parts)}."))
    return out


def spread_text(best: pd.Series, runner: pd.Series) -> str:
    """Whether the two are within each other's spread: the ranges of their measured step
    times (every run of a re-measured trial) overlap, so their order is within the noise."""
    keys = ("step_time_min_s", "step_time_max_s")
    if not all(present(row.get(k)) for row in (best, runner) for k in keys):
        return ""
    if best["step_time_max_s"] < runner["step_time_min_s"]:
        return (f" Every measured step of the recommended layout was faster than every one of the runner-up's "
                f"({best['step_time_max_s']:.3g} s at most against {runner['step_time_min_s']:.3g} s at least).")
    confirmed = all(present(row.get("confirmed")) and row["confirmed"] for row in (best, runner))
    return (f" The two are within each other's spread: their measured step times overlap "
            f"({best['step_time_min_s']:.3g}-{best['step_time_max_s']:.3g} s against "
            f"{runner['step_time_min_s']:.3g}-{runner['step_time_max_s']:.3g} s), so their order is within the "
            f"noise of the measurement{' even after both were measured again' if confirmed else ''}.")


def runner_up_text(question: Question, best: pd.Series, runner: pd.Series | None, objective: str) -> str:
    if runner is None:
        return "Only one layout completed: there is no runner-up to compare with."
    gap = runner["value"] / best["value"] - 1 if best["value"] else 0.0
    differs = [f"{k}={runner[k]}" for k in LAYOUT_COLUMNS if runner[k] != best[k]]
    text = (f"Trial {runner['trial']} ({runner['layout_short']}) at {objective_text(objective, runner['value'])} "
            f"is {-gap:.1%} {'slower' if objective == 'tokens_per_s' else 'lower'}; it differs in "
            f"{', '.join(differs)}.")
    text += spread_text(best, runner)
    if not (present(runner["peak_mem_gb"]) and present(best["peak_mem_gb"])):
        return text
    delta = runner["peak_mem_gb"] - best["peak_mem_gb"]
    if abs(delta) < 0.005:
        text += f" Its peak memory is the same ({runner['peak_mem_gb']:.2f} GiB)."
    else:
        text += (f" It needs {abs(delta):.2f} GiB {'less' if delta < 0 else 'more'} memory per GPU "
                 f"({runner['peak_mem_gb']:.2f} GiB).")
    budget = question.memory_budget_gb
    if budget and delta < 0:
        best_room, runner_room = 1 - best["peak_mem_gb"] / budget, 1 - runner["peak_mem_gb"] / budget
        if best_room < HEADROOM_WANTED <= runner_room and -gap <= SAFER_WITHIN:
            text += (f" It keeps {runner_room:.0%} headroom where the recommended layout keeps {best_room:.0%}: "
                     f"for a long run it is the safer choice, for {-gap:.1%} less throughput.")
            return text
    if abs(gap) <= TIED and delta < 0:
        text += (f" The two are within {TIED:.0%}, a tie on a few measured steps: the runner-up's "
                 f"smaller footprint may be the safer choice for a long run.")
    return text
