"""Our layouts in other frameworks' terms: Megatron-LM, torchtitan and DeepSpeed.

    megatron    Megatron-LM arguments (megatron_pipeline: the stage split and schedule)
    torchtitan  a torchtitan 0.3.0 command line: --module, --config and overrides
    deepspeed   a DeepSpeed config, where one applies
    ours        our own runtime: the layout string, `autotune trial`, torchrun
    command     `autotune export`: these files for any layout, without a sweep

No framework has every one of our settings, so each translation lists each setting
as `exact` (the same thing), `approximate` (the nearest there, written) or `none`
(no equivalent, nothing written). report/best.py writes them into best/.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autotune.config import ModelConfig
from autotune.plan.layout import Layout, parse_layout
from autotune.plan.stage_split import stage_layers
from autotune.record import Question


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
    args: list[str] = field(default_factory=list)  # a command line's arguments as written, for checking
    # What the framework holds beyond what the estimator prices for our runtime, (what, bytes a
    # GPU at most); None where we cannot tell (DeepSpeed: the model's own code holds the rest).
    beyond_ours: list[tuple[str, float]] | None = None


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
    def logits(self) -> float:
        """One micro-batch's logits on one rank of the last stage: mbs x seq/cp tokens, each
        over vocab/tp (every framework here splits the head over the vocabulary)."""
        L, m = self.layout, self.model
        return L.mbs * m.seq_len / L.cp * m.vocab_size / L.tp

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


def target(question: Question, layout_text: str) -> Target:
    """What a study's question and one of its layouts say about the run to translate."""
    return Target(Layout(**parse_layout(layout_text)), question.model_config, question.gpus, question.per_node)


def flag_lines(args: list[str]) -> list[list[str]]:
    """Group a flat argument list into one line per flag with its values (the scripts'
    bash arrays read one flag a line)."""
    lines: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not lines:
            lines.append([arg])
        else:
            lines[-1].append(arg)
    return lines


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
