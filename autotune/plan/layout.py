"""A parallel layout: how one training step is cut across GPUs.

    world size = pp * dp * cp * tp          (dp = dp_replicate * dp_shard)
    global batch = mbs * grad_accum * dp

`Layout` is plain data; `resolve` fills in derived degrees and checks every rule
(docs/layouts-and-sweep.md), each failure naming the key, the rule and the numbers, so a
user can fix a layout by reading one line. `enumerate_layouts` lists every valid
layout of a search space, with keys that make no difference folded away (zero at
dp=1, sp at tp=1, the schedule at pp=1) so that no layout appears twice.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

from autotune.config import ModelConfig
from autotune.errors import UsageError
from autotune.plan.schedules import DEFAULT_SCHEDULE, SCHEDULES, ScheduleName

# none; selective: the attention core (Megatron's selective); op: per-op, torchtitan's
# selective op policy (keep every other matmul output, recompute the rest); full: whole layers.
RECOMPUTE = ("none", "selective", "op", "full")
Zero = Literal[0, 1, 2, 3]
ZERO: tuple[Zero, ...] = get_args(Zero)
INT_KEYS = ("tp", "pp", "cp", "ep", "dp", "dp_shard", "zero", "mbs", "vpp", "sp", "recompute_layers")
LEAST = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 1, "dp_shard": 1, "mbs": 1, "vpp": 1, "recompute_layers": 0}
STR_KEYS = ("schedule", "recompute")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    dp_shard: int = 1  # ranks that shard parameters (zero >= 1); dp // dp_shard replicate (HSDP)
    zero: Zero = 0
    mbs: int = 1
    schedule: ScheduleName = DEFAULT_SCHEDULE
    vpp: int = 1
    recompute: str = "none"
    sp: int = 0
    recompute_layers: int = 0  # with recompute=full: the first K layers of each pipeline stage; 0 = all

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

    def grad_accum(self, model: ModelConfig) -> int:
        """Micro-batches per optimizer step on each data-parallel rank (= PP micro-batches)."""
        return model.global_batch_size // (self.mbs * self.dp)

    @functools.cached_property
    def text(self) -> str:
        """Every key in order: the layout's name in studies and trial commands. Made once:
        samplers and the controller compare the names of every layout of a space on each
        proposal. Keys added after the first release (LATER_KEYS) are left out at their
        defaults, so a study written before them resumes with the same names."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                        if f.name not in LATER_KEYS or getattr(self, f.name) != f.default)

    def __str__(self) -> str:
        return self.text

    def short(self) -> str:
        """Only the keys that differ from a single-GPU default, for tables and charts."""
        parts = [f"{k}={getattr(self, k)}" for k in ("tp", "pp", "cp", "ep", "dp")
                 if getattr(self, k) > 1]
        if self.dp_shard not in (1, self.dp):
            parts.append(f"dp_shard={self.dp_shard}")
        if self.dp > 1:
            parts.append(f"zero={self.zero}")
        if self.pp > 1:
            parts.append(f"{self.schedule}" + (f"x{self.vpp}" if self.vpp > 1 else ""))
        if self.sp:
            parts.append("sp")
        parts.append(f"mbs={self.mbs}")
        if self.recompute != "none":
            parts.append(f"rc={self.recompute}" + (f":{self.recompute_layers}" if self.recompute_layers else ""))
        return " ".join(parts)

    def canonical(self) -> "Layout":
        """The same layout with keys that change nothing at these degrees reset."""
        changes = self.folded()
        return dataclasses.replace(self, **changes) if changes else self

    def folded(self) -> dict[str, Any]:
        """The keys `canonical` resets, with their canonical values."""
        changes: dict[str, Any] = {}
        if self.pp == 1:
            changes.update(schedule=DEFAULT_SCHEDULE, vpp=1)
        if self.dp == 1:
            changes.update(zero=0, dp_shard=1)
        elif self.pp > 1 and self.zero == 3:
            changes.update(zero=2)  # under PP FSDP keeps parameters gathered through the step either way
        if self.tp == 1:
            changes.update(sp=0)
        if self.recompute != "full":
            changes.update(recompute_layers=0)
        return {k: v for k, v in changes.items() if getattr(self, k) != v}


# Every layout key, in the order of Layout's fields: the CSV's layout columns.
KEYS = tuple(f.name for f in dataclasses.fields(Layout))
LATER_KEYS = ("recompute_layers",)
assert set(KEYS) == set(INT_KEYS + STR_KEYS)


def parse_layout(text: str) -> dict[str, Any]:
    """'tp=2,pp=2,mbs=4' -> {'tp': 2, 'pp': 2, 'mbs': 4} (keys checked)."""
    given: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise UsageError(f"layout: expected key=value, got {item!r}")
        if key in given:
            raise UsageError(f"layout.{key}: given twice")
        if key in INT_KEYS:
            try:
                given[key] = int(value)
            except ValueError:
                raise UsageError(f"layout.{key}: must be an integer, got {value!r}") from None
        elif key in STR_KEYS:
            given[key] = value
        else:
            raise UsageError(f"layout.{key}: unknown key (known: {', '.join(INT_KEYS + STR_KEYS)})")
    return given


def resolve(given: dict[str, Any] | str, model: ModelConfig, gpus: int, gpus_per_node: int | None = None) -> Layout:
    """Fill in omitted keys (dp derived, dp_shard = dp, vpp 2 under a V schedule) and
    check every rule."""
    if isinstance(given, str):
        given = parse_layout(given)
    given = dict(given)
    for key, value in given.items():
        if key in INT_KEYS and (not isinstance(value, int) or isinstance(value, bool)):
            raise UsageError(f"layout.{key}: must be an integer, got {value!r}")
        if key in STR_KEYS and not isinstance(value, str):
            raise UsageError(f"layout.{key}: must be a string, got {value!r}")
    for key, least in LEAST.items():
        if key in given and given[key] < least:
            raise UsageError(f"layout.{key}: must be >= {least}, got {given[key]}")
    if gpus < 1:
        raise UsageError(f"gpus: must be >= 1, got {gpus}")
    tp, pp, cp = given.get("tp", 1), given.get("pp", 1), given.get("cp", 1)
    model_parallel = tp * pp * cp
    if "dp" not in given:
        if gpus % model_parallel:
            raise UsageError(f"layout: tp*pp*cp = {tp}*{pp}*{cp} = {model_parallel} must divide --gpus {gpus}")
        given["dp"] = gpus // model_parallel
    given.setdefault("dp_shard", given["dp"])
    schedule = SCHEDULES.get(given.get("schedule", DEFAULT_SCHEDULE))
    if "vpp" not in given and schedule is not None:
        given["vpp"] = schedule.default_vpp  # a V schedule runs two stages per rank: nothing else to choose
    layout = Layout(**given)
    check(layout, model, gpus, gpus_per_node)
    return layout


# -- the rules ------------------------------------------------------------------------------------
#
# Each rule reads a few of the layout's keys and says what is wrong, or None. `check` applies
# them in this order and raises the first problem; `enumerate_layouts` applies each as soon
# as the keys it reads are chosen, so a broken rule skips every combination of the keys
# after it (a large space has millions of combinations and a few per cent of them valid).

Problem = Callable[[Layout, ModelConfig, int, int | None], str | None]  # (layout, model, gpus, gpus_per_node)


class Rule(NamedTuple):
    keys: frozenset[str]  # the Layout fields it reads (dp counts as tp, pp and cp: it is derived from them)
    problem: Problem


RULES: list[Rule] = []


def rule(*keys: str) -> Callable[[Problem], Problem]:
    def register(problem: Problem) -> Problem:
        RULES.append(Rule(frozenset(keys), problem))
        return problem
    return register


@rule("tp", "pp", "cp", "dp")
def _world_size(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    if L.world_size != gpus:
        return f"layout: tp*pp*cp*dp = {L.tp}*{L.pp}*{L.cp}*{L.dp} = {L.world_size} must equal --gpus {gpus}"
    return None


@rule("dp", "dp_shard")
def _dp_shard_divides(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    return f"layout.dp_shard: must divide dp ({L.dp}), got {L.dp_shard}" if L.dp % L.dp_shard else None


@rule("zero")
def _zero_known(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    return None if L.zero in ZERO else f"layout.zero: must be one of 0, 1, 2, 3, got {L.zero}"


@rule("dp", "dp_shard", "zero")
def _hsdp_shards_state(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    if L.dp_shard < L.dp and L.zero == 0:
        return (f"layout.dp_shard: HSDP (dp_shard {L.dp_shard} < dp {L.dp}) shards state, "
                f"so it needs zero >= 1")
    return None


@rule("sp")
def _sp_flag(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    return None if L.sp in (0, 1) else f"layout.sp: must be 0 or 1, got {L.sp}"


@rule("recompute")
def _recompute_known(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    if L.recompute not in RECOMPUTE:
        return f"layout.recompute: must be one of {', '.join(RECOMPUTE)}, got {L.recompute!r}"
    return None


@rule("recompute", "recompute_layers")
def _recompute_layers_need_full(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    if L.recompute_layers and L.recompute != "full":
        return (f"layout.recompute_layers: recomputes the first K layers of each stage in full, so it "
                f"needs recompute=full, got recompute={L.recompute}")
    return None


@rule("schedule")
def _schedule_known(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    if L.schedule not in SCHEDULES:
        return f"layout.schedule: must be one of {', '.join(SCHEDULES)}, got {L.schedule!r}"
    return None


@rule("tp")
def _tp_splits_evenly(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    """Tensor parallel: heads, kv heads, the MLP and the vocabulary split evenly."""
    for name, size in (("num_heads", m.num_heads), ("num_kv_heads", m.num_kv_heads or m.num_heads),
                       ("ffn_hidden_size", m.ffn_hidden_size), ("vocab_size", m.vocab_size)):
        if size % L.tp:
            return f"layout.tp: {name} ({size}) must divide by tp ({L.tp})"
    return None


@rule("tp")
def _tp_splits_mamba(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    """Tensor parallel of Mamba-2 blocks: heads and B/C groups split evenly (as Megatron's)."""
    if m.mamba is not None:
        for name in ("num_heads", "n_groups"):
            if getattr(m.mamba, name) % L.tp:
                return f"layout.tp: mamba.{name} ({getattr(m.mamba, name)}) must divide by tp ({L.tp})"
    return None


@rule("cp")
def _cp_not_with_mamba(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    if L.cp > 1 and m.mamba is not None:
        return "layout.cp: context parallel is not built for Mamba-2 blocks (use cp=1)"
    return None


@rule("tp")
def _tp_inside_a_node(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    """One node means one scale-up domain (gpus_per_node: the GPUs that share NVLink; 72 on an NVL72 rack)."""
    if gpus_per_node and (L.tp > gpus_per_node or gpus_per_node % L.tp):
        return (f"layout.tp: tp ({L.tp}) must divide gpus_per_node ({gpus_per_node}): "
                f"tensor parallel stays inside a node (the scale-up domain of {gpus_per_node} GPUs)")
    return None


@rule("sp", "tp")
def _sp_needs_tp(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    return "layout.sp: sequence parallel needs tp > 1" if L.sp and L.tp == 1 else None


@rule("sp", "tp", "cp")
def _sp_splits_the_sequence(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    if L.sp and m.seq_len % (L.cp * L.tp):
        return f"layout.sp: seq_len ({m.seq_len}) must divide by cp*tp ({L.cp * L.tp}) with sequence parallel"
    return None


@rule("cp")
def _cp_head_tail_chunks(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    """Context parallel: head-tail sharding cuts the sequence into 2*cp chunks."""
    if L.cp > 1 and m.seq_len % (2 * L.cp):
        return f"layout.cp: seq_len ({m.seq_len}) must divide by 2*cp ({2 * L.cp})"
    return None


@rule("pp", "vpp")
def _a_layer_per_stage(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    """Pipeline parallel: pp*vpp stages of whole layers (stage_split.py balances them, so
    they need not divide evenly)."""
    if m.num_layers < L.pp * L.vpp:
        return (f"layout.pp: every pipeline stage needs a layer: num_layers ({m.num_layers}) "
                f"must be at least pp*vpp ({L.pp * L.vpp})")
    return None


@rule("pp", "vpp")
def _virtual_stages_need_pp(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    return "layout.vpp: virtual stages need pp > 1" if L.pp == 1 and L.vpp > 1 else None


@rule("recompute_layers", "pp", "vpp")
def _recompute_layers_below_a_stage(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    stages = L.pp * L.vpp
    if L.recompute_layers and L.recompute_layers * stages >= m.num_layers:
        return (f"layout.recompute_layers: the first K layers of each of the {stages} stages, so K "
                f"({L.recompute_layers}) must be below num_layers / (pp*vpp) = {m.num_layers}/{stages}; "
                f"recompute_layers=0 recomputes every layer")
    return None


@rule("pp", "vpp", "schedule")
def _schedule_stages(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    if L.pp > 1 and (problem := SCHEDULES[L.schedule].vpp_error(L.vpp)):
        return f"layout.vpp: schedule {L.schedule} {problem}"
    return None


@rule("ep", "dp_shard", "cp")
def _experts_split_evenly(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    """Expert parallel: experts split evenly over EP ranks carved from dp_shard x cp."""
    if L.ep == 1:
        return None
    if m.moe is None:
        return f"layout.ep: expert parallel needs an MoE model ({m.name} has no moe block)"
    if m.moe.num_experts % L.ep:
        return f"layout.ep: num_experts ({m.moe.num_experts}) must divide by ep ({L.ep})"
    if (L.dp_shard * L.cp) % L.ep:
        return f"layout.ep: ep ({L.ep}) must divide dp_shard*cp ({L.dp_shard}*{L.cp})"
    return None


@rule("mbs", "dp")
def _whole_microbatches(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    """Batch: every data-parallel rank gets whole micro-batches."""
    if m.global_batch_size % (L.mbs * L.dp):
        return f"layout.mbs: global_batch_size ({m.global_batch_size}) must divide by mbs*dp ({L.mbs}*{L.dp})"
    return None


@rule("pp", "schedule", "mbs", "dp")
def _schedule_microbatches(L: Layout, m: ModelConfig, gpus: int, gpus_per_node: int | None) -> str | None:
    """What torch's schedule asks of the micro-batch count, grad_accum =
    global_batch_size / (mbs*dp) (autotune/plan/schedules.py holds each schedule's rule)."""
    if L.pp == 1:
        return None
    count = L.grad_accum(m)
    problem = SCHEDULES[L.schedule].microbatch_rule(L.pp, count)
    if problem:
        where = f"grad_accum = global_batch_size / (mbs*dp) = {m.global_batch_size} / ({L.mbs}*{L.dp}) = {count}"
        return f"layout.mbs: schedule {L.schedule} {problem}, got {where}"
    return None


def check(layout: Layout, model: ModelConfig, gpus: int, gpus_per_node: int | None = None) -> None:
    """Raise UsageError naming the first rule the layout breaks."""
    for r in RULES:
        if problem := r.problem(layout, model, gpus, gpus_per_node):
            raise UsageError(problem)


# -- every layout of a space ----------------------------------------------------------------------

DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Layout)} | {"dp_shard": "dp"}


def _unchecked_layout(fields: dict[str, Any]) -> Layout:
    """Layout(**fields) without the dataclass's __init__ (a frozen one sets each field through
    object.__setattr__): the enumeration builds a million of them, and its rules check them.
    `fields`: every key of KEYS and nothing else."""
    layout = object.__new__(Layout)
    layout.__dict__.update(fields)
    return layout


# The keys a layout's state depends on (what each rank holds of the parameters, gradients
# and optimizer state): the degrees and the sharding. estimate_memory.state_floor reads only
# these, so a listing can drop every layout below a combination of them whose state alone is
# over the budget without building one (enumerate_layouts' `skip`).
STATE_KEYS = ("tp", "pp", "cp", "ep", "dp_shard", "zero", "vpp", "schedule")

# The order keys are chosen in while enumerating: the state keys first (the degrees first among
# them: most rules read them), then what each later rule adds. Only the pruning depends on it,
# not the result.
_CHOICE_ORDER = STATE_KEYS + ("sp", "recompute", "recompute_layers", "mbs")
assert set(_CHOICE_ORDER) == set(KEYS) - {"dp"}


def enumerate_layouts(model: ModelConfig, gpus: int, space: dict[str, Any], gpus_per_node: int | None = None
                      ) -> list[Layout]:
    """Every valid layout whose keys take values from `space` ({key: [values]}), each
    canonical (Layout.canonical) and once: what resolving every combination would give.

    `dp` is always derived; `dp_shard` values larger than dp are skipped, and the value
    "dp" (or a missing dp_shard key) means dp_shard = dp; a missing vpp is 2 under a V
    schedule, as `resolve` fills it. Order follows the space's value order, outermost key
    first (INT_KEYS then STR_KEYS), so it is stable across runs: a layout stands where the
    first combination that gives it stands.
    """
    return enumerate_layouts_skipping(model, gpus, space, gpus_per_node)[0]


def enumerate_layouts_skipping(model: ModelConfig, gpus: int, space: dict[str, Any], gpus_per_node: int | None = None,
                               skip: Callable[[Layout], bool] | None = None) -> tuple[list[Layout], int]:
    """(enumerate_layouts' layouts but those `skip` is true for, how many valid layouts it
    was true for). `skip` reads only STATE_KEYS (the rest of the layout it is given is at
    the defaults) and is asked once per canonical combination of them, so the layouts it
    drops are counted, never built.

    Keys are chosen one at a time (_CHOICE_ORDER) and each rule is applied as soon as the
    keys it reads are known, so a broken rule prunes every combination below it (a large
    model's space has millions of combinations and a small share of valid layouts:
    benchmarks/estimate_speed.py). It goes in two stages: every valid canonical combination of the
    state keys (a prefix), then the other keys below each prefix not skipped. Combinations
    of the state keys with the same canonical values have the same layouts below them
    (folding changes nothing, Layout.folded), so each canonical prefix is expanded once, at
    its first place in the nesting.
    """
    if gpus < 1:
        raise UsageError(f"gpus: must be >= 1, got {gpus}")
    nesting = [k for k in INT_KEYS + STR_KEYS if k in space and k != "dp"]
    values = {k: list(space[k]) for k in nesting}
    for key, choices in values.items():
        numbers = [v for v in choices if v != "dp"]  # dp_shard's "dp"
        if key in LEAST and min(numbers, default=LEAST[key]) < LEAST[key]:
            raise UsageError(f"layout.{key}: must be >= {LEAST[key]}, got {min(numbers)}")
    weight, size = {}, 1  # a combination's place in the nesting: the sum of index * weight over keys
    for key in reversed(nesting):
        weight[key] = size
        size *= len(values[key])
    chosen = [k for k in _CHOICE_ORDER if k in values]
    split = sum(k in STATE_KEYS for k in chosen)  # chosen[:split]: the state keys of the space

    def known(field: str, keys: set[str]) -> bool:
        """Whether a field is fixed once `keys` are chosen: chosen, absent from the space
        (its default), or derived from fields that are known."""
        if field == "dp":
            return all(known(k, keys) for k in ("tp", "pp", "cp"))
        if field == "dp_shard":
            return (field in keys or field not in values) and known("dp", keys)
        if field == "vpp" and field not in values:
            return known("schedule", keys)
        return field in keys or field not in values

    due, pending = [], list(RULES)  # due[d]: the rules to apply once chosen[:d] are chosen
    for depth in range(len(chosen) + 1):
        keys = set(chosen[:depth])
        due.append([r for r in pending if all(known(f, keys) for f in r.keys)])
        pending = [r for r in pending if r not in due[-1]]

    def layout_of(given: dict[str, Any]) -> Layout:
        """The layout `resolve` makes of a (partial) combination; unchosen keys at their defaults."""
        fields = DEFAULTS | given
        fields["dp"] = max(1, gpus // (fields["tp"] * fields["pp"] * fields["cp"]))
        if fields["dp_shard"] == "dp":
            fields["dp_shard"] = fields["dp"]
        if "vpp" not in values:
            schedule = SCHEDULES.get(fields["schedule"])
            fields["vpp"] = schedule.default_vpp if schedule is not None else 1
        return _unchecked_layout(fields)

    def canonical_of(given: dict[str, Any]) -> Layout:
        layout = layout_of(given)
        folded = layout.folded()
        return _unchecked_layout(layout.__dict__ | folded) if folded else layout

    def broken(layout: Layout, rules: list[Rule]) -> bool:
        return any(r.problem(layout, model, gpus, gpus_per_node) for r in rules)

    def reads(r: Rule) -> set[str]:
        """The chosen keys a rule's verdict depends on, through the derived fields too."""
        fields = set(r.keys)
        if "dp" in fields or ("dp_shard" in fields and "dp_shard" not in values):
            fields |= {"tp", "pp", "cp"}
        if "vpp" in fields and "vpp" not in values:
            fields.add("schedule")
        return fields & set(values)

    # A key no later rule reads can skip a value whose canonical value an earlier value of it
    # already gave: the combinations below are the same, and so are their canonical layouts
    # (no other key's folding depends on schedule, vpp, zero, dp_shard, sp or recompute_layers).
    read_later = [set().union(*(reads(r) for rules in due[depth + 2:] for r in rules)) for depth in range(len(chosen))]
    collapsible = [key in ("schedule", "vpp", "zero", "dp_shard", "sp", "recompute_layers") and key not in read_later[d]
                   for d, key in enumerate(chosen)]

    def choose(depth: int, stop: int, given: dict[str, Any], place: int,
               reached: Callable[[dict[str, Any], int], None]) -> None:
        """Every valid choice of chosen[depth:stop] below `given`; `reached` gets each."""
        if depth == stop:
            reached(given, place)
            return
        key, rules, taken = chosen[depth], due[depth + 1], set()
        for index, value in enumerate(values[key]):
            given[key] = value
            if rules or collapsible[depth]:
                layout = layout_of(given)
                if broken(layout, rules):
                    continue
                if collapsible[depth]:
                    canonical = layout.folded().get(key, getattr(layout, key))
                    if canonical in taken:
                        continue
                    taken.add(canonical)
            choose(depth + 1, stop, given, place + index * weight[key], reached)
        given.pop(key, None)  # absent where the key has no values

    # canonical state values -> (least place, a combination)
    prefixes: dict[tuple[Any, ...], tuple[int, dict[str, Any]]] = {}

    def add_prefix(given: dict[str, Any], place: int) -> None:
        canonical = canonical_of(given)
        state = tuple(getattr(canonical, k) for k in STATE_KEYS)
        if place < prefixes.get(state, (size,))[0]:
            prefixes[state] = (place, dict(given))

    place_of: dict[Layout, int] = {}

    def add_layout(given: dict[str, Any], place: int) -> None:
        layout = canonical_of(given)
        if place < place_of.get(layout, size):
            place_of[layout] = place

    # How many layouts lie below a skipped prefix depends only on the canonical values of the
    # state keys that the later rules and the folding read (the degrees, for dp and sp): one
    # count per signature.
    signature_keys = sorted(set().union({"tp", "pp", "cp"}, *(reads(r) for rules in due[split + 1:] for r in rules))
                            & set(chosen[:split]))
    counts: dict[tuple[Any, ...], int] = {}

    def count_below(given: dict[str, Any], canonical: Layout) -> int:
        signature = tuple(getattr(canonical, k) for k in signature_keys)
        if signature not in counts:
            suffixes = set()
            choose(split, len(chosen), dict(given), 0, lambda combination, _: suffixes.add(
                tuple(getattr(canonical_of(combination), k) for k in chosen[split:])))
            counts[signature] = len(suffixes)
        return counts[signature]

    skipped = 0
    if not broken(layout_of({}), due[0]):
        choose(0, split, {}, 0, add_prefix)
    for place, given in prefixes.values():
        if skip is not None and skip(canonical := canonical_of(given)):
            skipped += count_below(given, canonical)
        else:
            choose(split, len(chosen), given, place, add_layout)
    return sorted(place_of, key=place_of.__getitem__), skipped
