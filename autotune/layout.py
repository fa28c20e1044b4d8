"""A parallel layout: how one training step is cut across GPUs.

    world size = pp * dp * cp * tp          (dp = dp_replicate * dp_shard)
    global batch = mbs * grad_accum * dp

`Layout` is plain data; `resolve` fills in derived degrees and checks every rule
(README, "Layouts"), each failure naming the key, the rule and the numbers, so a
user can fix a layout by reading one line. `enumerate_layouts` lists every valid
layout of a search space, with keys that make no difference folded away (zero at
dp=1, sp at tp=1, the schedule at pp=1) so that no layout appears twice.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

from autotune.config import ModelConfig
from autotune.errors import UsageError
from autotune.schedules import DEFAULT_SCHEDULE, SCHEDULES

# none; selective: the attention core (Megatron's selective); op: per-op, torchtitan's
# selective op policy (keep every other matmul output, recompute the rest); full: whole layers.
RECOMPUTE = ("none", "selective", "op", "full")
ZERO = (0, 1, 2, 3)
INT_KEYS = ("tp", "pp", "cp", "ep", "dp", "dp_shard", "zero", "mbs", "vpp", "sp", "recompute_layers")
STR_KEYS = ("schedule", "recompute")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    dp_shard: int = 1  # ranks that shard parameters (zero >= 1); dp // dp_shard replicate (HSDP)
    zero: int = 0
    mbs: int = 1
    schedule: str = DEFAULT_SCHEDULE
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
        changes = {}
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
        return dataclasses.replace(self, **changes)


# Every layout key, in the order of Layout's fields: the CSV's layout columns.
KEYS = tuple(f.name for f in dataclasses.fields(Layout))
LATER_KEYS = ("recompute_layers",)
assert set(KEYS) == set(INT_KEYS + STR_KEYS)


def parse_layout(text: str) -> dict:
    """'tp=2,pp=2,mbs=4' -> {'tp': 2, 'pp': 2, 'mbs': 4} (keys checked)."""
    given: dict = {}
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


def resolve(given: dict | str, model: ModelConfig, gpus: int, gpus_per_node: int | None = None) -> Layout:
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
    for key in ("tp", "pp", "cp", "ep", "dp", "dp_shard", "mbs", "vpp"):
        if key in given and given[key] < 1:
            raise UsageError(f"layout.{key}: must be >= 1, got {given[key]}")
    if given.get("recompute_layers", 0) < 0:
        raise UsageError(f"layout.recompute_layers: must be >= 0, got {given['recompute_layers']}")
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
    if "vpp" not in given and schedule is not None and schedule.placement == "v":
        given["vpp"] = 2  # a V schedule runs two stages per rank: nothing else to choose
    layout = Layout(**given)
    check(layout, model, gpus, gpus_per_node)
    return layout


def check(layout: Layout, model: ModelConfig, gpus: int, gpus_per_node: int | None = None) -> None:
    """Raise UsageError naming the first rule the layout breaks."""
    L, m = layout, model
    if L.world_size != gpus:
        raise UsageError(f"layout: tp*pp*cp*dp = {L.tp}*{L.pp}*{L.cp}*{L.dp} = {L.world_size} "
                         f"must equal --gpus {gpus}")
    if L.dp % L.dp_shard:
        raise UsageError(f"layout.dp_shard: must divide dp ({L.dp}), got {L.dp_shard}")
    if L.zero not in ZERO:
        raise UsageError(f"layout.zero: must be one of 0, 1, 2, 3, got {L.zero}")
    if L.dp_shard < L.dp and L.zero == 0:
        raise UsageError(f"layout.dp_shard: HSDP (dp_shard {L.dp_shard} < dp {L.dp}) shards state, "
                         f"so it needs zero >= 1")
    if L.sp not in (0, 1):
        raise UsageError(f"layout.sp: must be 0 or 1, got {L.sp}")
    if L.recompute not in RECOMPUTE:
        raise UsageError(f"layout.recompute: must be one of {', '.join(RECOMPUTE)}, got {L.recompute!r}")
    if L.recompute_layers and L.recompute != "full":
        raise UsageError(f"layout.recompute_layers: recomputes the first K layers of each stage in full, so it "
                         f"needs recompute=full, got recompute={L.recompute}")
    if L.schedule not in SCHEDULES:
        raise UsageError(f"layout.schedule: must be one of {', '.join(SCHEDULES)}, got {L.schedule!r}")
    schedule = SCHEDULES[L.schedule]
    # Tensor parallel: heads, kv heads, the MLP and the vocabulary split evenly; one node, meaning
    # one scale-up domain (gpus_per_node: the GPUs that share NVLink; 72 on an NVL72 rack).
    for name, size in (("num_heads", m.num_heads), ("num_kv_heads", m.num_kv_heads),
                       ("ffn_hidden_size", m.ffn_hidden_size), ("vocab_size", m.vocab_size)):
        if size % L.tp:
            raise UsageError(f"layout.tp: {name} ({size}) must divide by tp ({L.tp})")
    if gpus_per_node and (L.tp > gpus_per_node or gpus_per_node % L.tp):
        raise UsageError(f"layout.tp: tp ({L.tp}) must divide gpus_per_node ({gpus_per_node}): "
                         f"tensor parallel stays inside a node (the scale-up domain of {gpus_per_node} GPUs)")
    if L.sp and L.tp == 1:
        raise UsageError("layout.sp: sequence parallel needs tp > 1")
    if L.sp and m.seq_len % (L.cp * L.tp):
        raise UsageError(f"layout.sp: seq_len ({m.seq_len}) must divide by cp*tp ({L.cp * L.tp}) "
                         f"with sequence parallel")
    # Context parallel: head-tail sharding cuts the sequence into 2*cp chunks.
    if L.cp > 1 and m.seq_len % (2 * L.cp):
        raise UsageError(f"layout.cp: seq_len ({m.seq_len}) must divide by 2*cp ({2 * L.cp})")
    # Pipeline parallel: pp*vpp stages of whole layers (stage_split.py balances them, so
    # they need not divide evenly); schedules need their stage counts.
    stages = L.pp * L.vpp
    if m.num_layers < stages:
        raise UsageError(f"layout.pp: every pipeline stage needs a layer: num_layers ({m.num_layers}) "
                         f"must be at least pp*vpp ({stages})")
    if L.pp == 1 and L.vpp > 1:
        raise UsageError("layout.vpp: virtual stages need pp > 1")
    if L.recompute_layers and L.recompute_layers * stages >= m.num_layers:
        raise UsageError(f"layout.recompute_layers: the first K layers of each of the {stages} stages, so K "
                         f"({L.recompute_layers}) must be below num_layers / (pp*vpp) = {m.num_layers}/{stages}; "
                         f"recompute_layers=0 recomputes every layer")
    if L.pp > 1 and (problem := schedule.vpp_error(L.vpp)):
        raise UsageError(f"layout.vpp: schedule {L.schedule} {problem}")
    # Expert parallel: experts split evenly over EP ranks carved from dp_shard x cp.
    if L.ep > 1:
        if m.moe is None:
            raise UsageError(f"layout.ep: expert parallel needs an MoE model ({m.name} has no moe block)")
        if m.moe.num_experts % L.ep:
            raise UsageError(f"layout.ep: num_experts ({m.moe.num_experts}) must divide by ep ({L.ep})")
        if (L.dp_shard * L.cp) % L.ep:
            raise UsageError(f"layout.ep: ep ({L.ep}) must divide dp_shard*cp ({L.dp_shard}*{L.cp})")
    # Batch: every data-parallel rank gets whole micro-batches.
    if m.global_batch_size % (L.mbs * L.dp):
        raise UsageError(f"layout.mbs: global_batch_size ({m.global_batch_size}) must divide by "
                         f"mbs*dp ({L.mbs}*{L.dp})")
    if L.pp > 1:
        check_microbatches(L, m)


def check_microbatches(L: Layout, m: ModelConfig) -> None:
    """What torch's schedule asks of the micro-batch count, grad_accum =
    global_batch_size / (mbs*dp) (autotune/schedules.py holds each schedule's rule)."""
    count = L.grad_accum(m)
    problem = SCHEDULES[L.schedule].microbatch_rule(L.pp, count)
    if problem:
        where = f"grad_accum = global_batch_size / (mbs*dp) = {m.global_batch_size} / ({L.mbs}*{L.dp}) = {count}"
        raise UsageError(f"layout.mbs: schedule {L.schedule} {problem}, got {where}")


def enumerate_layouts(model: ModelConfig, gpus: int, space: dict, gpus_per_node: int | None = None
                      ) -> list[Layout]:
    """Every valid layout whose keys take values from `space` ({key: [values]}).

    `dp` is always derived; `dp_shard` values larger than dp are skipped, and the value
    "dp" (or a missing dp_shard key) means dp_shard = dp. Order follows the space's
    value order, outermost key first, so it is stable across runs.
    """
    keys = [k for k in INT_KEYS + STR_KEYS if k in space and k != "dp"]
    seen: dict[Layout, None] = {}
    for values in itertools.product(*(space[k] for k in keys)):
        given = dict(zip(keys, values))
        if given.get("dp_shard") == "dp":
            del given["dp_shard"]
        try:
            layout = resolve(given, model, gpus, gpus_per_node).canonical()
            check(layout, model, gpus, gpus_per_node)
        except UsageError:
            continue
        seen.setdefault(layout)
    return list(seen)
