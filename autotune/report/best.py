"""best/: the recommended layout for our runtime and translated for other frameworks.

    layout.txt          the layout string for `autotune trial --layout`, and the command
    model.yaml          the model, so the commands here run as they are
    torchrun.sh         the torchrun command for our runtime
    megatron_args.sh    Megatron-LM arguments (and the environment they need)
    torchtitan.sh       a torchtitan 0.3.0 command line: --module, --config and overrides
    deepspeed.json      a DeepSpeed config, where one applies (deepspeed_notes.md says how it maps)
    README.md           what each file holds, every setting's mapping, and the memory each framework holds
"""

from __future__ import annotations

from pathlib import Path

import yaml

from autotune.config import human_bytes
from autotune.errors import UsageError
from autotune.estimate import budget_bytes, estimate
from autotune.export import Export, Target, comment_block, target
from autotune.export.deepspeed import deepspeed
from autotune.export.megatron import megatron
from autotune.export.ours import runtime
from autotune.export.torchtitan import torchtitan
from autotune.record import Question

# Every file best/ may hold, and those earlier versions wrote (torchtitan.toml), so none is left stale.
FILES = ("README.md", "layout.txt", "model.yaml", "torchrun.sh", "megatron_args.sh", "torchtitan.sh",
         "torchtitan.toml", "deepspeed.json", "deepspeed_notes.md")


def exports(question: Question, layout_text: str) -> list[Export]:
    t = target(question, layout_text)
    return [megatron(t), torchtitan(t), deepspeed(t)]


def write_best(folder: Path, question: Question, best) -> list[Path]:
    """Write best/ for the recommended trial (a row of the trial table, or for `autotune
    export` a mapping with the layout alone); returns the files."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in FILES:  # a previous report's files, e.g. a DeepSpeed config that no longer applies
        (folder / name).unlink(missing_ok=True)
    t = target(question, best["layout"])
    layout_txt, torchrun = runtime(t, question, recommended=best.get("trial") is not None)
    written = {"layout.txt": layout_txt, "torchrun.sh": torchrun,
               "model.yaml": yaml.safe_dump(question.model, sort_keys=False)}
    translations = exports(question, best["layout"])
    for x in translations:
        if x.content is not None:
            written[x.filename] = x.content
    deepspeed_export = translations[-1]
    if deepspeed_export.content is not None:
        written["deepspeed_notes.md"] = ("# deepspeed.json: how it maps\n\nJSON has no comments, so the mapping "
                                         "of deepspeed.json is here.\n\n" + "\n".join(
                                             comment_block(deepspeed_export.mappings, prefix="")) + "\n")
    written["README.md"] = readme(t, best, translations) + "\n".join(memory_section(t, question, translations)) + "\n"
    for name, text in written.items():
        (folder / name).write_text(text, encoding="utf-8")
    for name in ("torchrun.sh", "torchtitan.sh"):
        if name in written:
            (folder / name).chmod(0o755)
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
    measured = (f"trial {int(best['trial'])}: {', '.join(figures)}" if best.get("trial") is not None else
                "not measured (written by `autotune export`; `autotune trial` with layout.txt measures it)")
    lines = [f"# The {'recommended ' if best.get('trial') is not None else ''}layout: {L.short()}", "",
             f"{t.model.name} on {t.gpus} GPUs, {measured}.", "",
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


def memory_section(t: Target, question: Question, translations: list[Export]) -> list[str]:
    """The estimator's peak for our runtime on a GPU, in the model's precision, and what
    each framework's file would hold beyond it (Export.beyond_ours), against the budget:
    a layout can fit in our runtime and not in a framework that holds more. The terms
    added may peak at different moments of a step, so each framework's figure is a
    bound, not a prediction."""
    hardware = question.hardware_config
    budget = budget_bytes(hardware, question.memory_budget_gb)
    lines = ["", "## Memory in each framework", ""]
    try:
        ours = estimate(t.model, t.layout, hardware, budget, device="cuda").peak_mem_bytes
    except UsageError as e:  # the hardware lacks the model's precision
        return lines + [f"Not priced: {e}."]

    def row(name: str, beyond: list[tuple[str, float]]) -> str:
        peak = ours + sum(b for _, b in beyond)
        fits = "-" if budget is None else "yes" if peak <= budget else "**no**"
        what = "; ".join(f"{why}: {human_bytes(b)}" for why, b in beyond) or "nothing we know of"
        return f"| {name} | {what} | {human_bytes(peak)} | {fits} |"

    lines += [f"The estimator's peak for our runtime on a GPU (its worst rank, in {t.model.dtype}): {human_bytes(ours)}"
              + (f" of the {human_bytes(budget)} budget." if budget else " (no memory budget)."),
              "What each framework's command holds beyond it (the notes above say why), added as if at one "
              "moment: an upper bound.", "",
              "| framework | beyond ours | peak, at most | within the budget |", "|---|---|---:|---|",
              row("our runtime (torchrun.sh)", []).replace("nothing we know of", "-")]
    lines += [row(f"{x.framework} ({x.filename})", x.beyond_ours) for x in translations
              if x.content is not None and x.beyond_ours is not None]
    return lines
