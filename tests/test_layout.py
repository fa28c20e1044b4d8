import dataclasses

import pytest

from autotune.config import load_model, model_from_dict
from autotune.errors import UsageError
from autotune.estimate import reasonable_space
from autotune.plan.layout import Layout, enumerate_layouts, enumerate_layouts_skipping, parse_layout, resolve

TINY = load_model("tiny")  # 8 heads, 4 kv heads, ffn 128, vocab 256, 8 layers, seq 64, batch 16
MOE = load_model("tiny-moe")  # 8 experts


def test_parse_and_defaults():
    assert parse_layout("tp=2, pp=2,schedule=gpipe") == {"tp": 2, "pp": 2, "schedule": "gpipe"}
    layout = resolve("tp=2", TINY, 8)
    assert (layout.dp, layout.dp_shard, layout.zero, layout.mbs, layout.sp) == (4, 4, 0, 1, 0)
    assert layout.grad_accum(TINY) == 4  # 16 / (1 * 4)
    assert resolve("", TINY, 1) == Layout()


def test_full_string_round_trips():
    layout = resolve("tp=2,pp=2,zero=3,dp_shard=1,mbs=2,sp=1,recompute=full", TINY, 8)
    assert resolve(str(layout), TINY, 8) == layout
    assert layout.dp_replicate == 2


@pytest.mark.parametrize("text, message", [
    ("tp=2,colour=3", "layout.colour: unknown key"),
    ("tp=two", "layout.tp: must be an integer, got 'two'"),
    ("tp", "layout: expected key=value, got 'tp'"),
    ("tp=1,tp=2", "layout.tp: given twice"),
])
def test_parse_errors(text, message):
    with pytest.raises(UsageError, match="^" + message):
        parse_layout(text)


@pytest.mark.parametrize("text, gpus, message", [
    ("tp=0", 4, r"layout.tp: must be >= 1, got 0"),
    ("tp=3", 6, r"layout.tp: num_heads \(8\) must divide by tp \(3\)"),
    ("tp=8", 8, r"layout.tp: num_kv_heads \(4\) must divide by tp \(8\)"),
    ("tp=2,pp=2", 6, r"layout: tp\*pp\*cp = 2\*2\*1 = 4 must divide --gpus 6"),
    ("tp=2,dp=2", 8, r"layout: tp\*pp\*cp\*dp = 2\*1\*1\*2 = 4 must equal --gpus 8"),
    ("dp_shard=3", 4, r"layout.dp_shard: must divide dp \(4\), got 3"),
    ("dp_shard=2", 4, r"layout.dp_shard: HSDP \(dp_shard 2 < dp 4\) shards state, so it needs zero >= 1"),
    ("zero=4", 2, r"layout.zero: must be one of 0, 1, 2, 3, got 4"),
    ("sp=1", 2, r"layout.sp: sequence parallel needs tp > 1"),
    ("cp=64", 64, r"layout.cp: seq_len \(64\) must divide by 2\*cp \(128\)"),
    ("pp=4,vpp=4,schedule=interleaved_1f1b", 4,
     r"layout.pp: every pipeline stage needs a layer: num_layers \(8\) must be at least pp\*vpp \(16\)"),
    ("pp=4,mbs=8", 4, r"layout.mbs: schedule 1f1b needs at least pp \(4\) micro-batches per step, got "
                      r"grad_accum = global_batch_size / \(mbs\*dp\) = 16 / \(8\*1\) = 2"),
    ("pp=2,schedule=dualpipev,vpp=2,mbs=8", 2,
     r"layout.mbs: schedule dualpipev needs at least 2\*pp \(4\) micro-batches per step \(one per stage\)"),
    ("pp=3,schedule=interleaved_1f1b,vpp=2", 3, r"layout.mbs: schedule interleaved_1f1b runs micro-batches in "
                                                r"rounds of pp, so grad_accum must be a multiple of "
                                                r"max\(1, grad_accum // pp\) = 5"),
    ("pp=2,vpp=2", 2, r"layout.vpp: schedule 1f1b runs one stage per rank, so vpp must be 1"),
    ("pp=2,schedule=zbv,vpp=4", 2, r"layout.vpp: schedule zbv runs two stages per rank, so vpp must be 2"),
    ("vpp=2", 1, r"layout.vpp: virtual stages need pp > 1"),
    ("pp=2,schedule=wavy", 2, r"layout.schedule: must be one of gpipe, 1f1b"),
    ("recompute=some", 1, r"layout.recompute: must be one of none, selective, op, full, got 'some'"),
    ("mbs=3", 2, r"layout.mbs: global_batch_size \(16\) must divide by mbs\*dp \(3\*2\)"),
    ("ep=2", 2, r"layout.ep: expert parallel needs an MoE model"),
])
def test_rules_name_the_key_and_the_numbers(text, gpus, message):
    with pytest.raises(UsageError, match="^" + message):
        resolve(text, TINY, gpus)


TORCH_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
                   "zero_bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}


def test_a_v_schedule_without_vpp_takes_its_two_stages_per_rank():
    for schedule in ("zbv", "dualpipev"):
        assert resolve(f"pp=2,schedule={schedule}", TINY, 2).vpp == 2
    assert resolve("pp=2,schedule=interleaved_1f1b", TINY, 2).vpp == 1  # looped: vpp is a choice


def test_pipeline_rules_accept_exactly_what_torch_schedules_accept():
    """For every schedule, pp 2-4 and 1-12 micro-batches: layout.check passes exactly the
    cases whose torch schedule can be built (torch raises in its constructors). Looped
    schedules at vpp=2: torch's schedule lister needs two stages per rank for them."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    for schedule, torch_name in TORCH_SCHEDULES.items():
        vpp = 1 if schedule in ("gpipe", "1f1b") else 2
        for pp in (2, 3, 4):
            for microbatches in range(1, 13):
                model = dataclasses.replace(TINY, num_layers=24, global_batch_size=microbatches)
                try:
                    resolve(f"pp={pp},schedule={schedule},vpp={vpp}", model, pp)
                    ours = True
                except UsageError:
                    ours = False
                try:
                    get_schedule_ops(torch_name, pp, microbatches, vpp if vpp > 1 else None)
                    theirs = True
                except (ValueError, AssertionError):
                    theirs = False
                assert ours == theirs, (schedule, pp, microbatches)


def test_moe_rules():
    assert resolve("ep=4", MOE, 4).ep == 4
    with pytest.raises(UsageError, match=r"layout.ep: num_experts \(8\) must divide by ep \(3\)"):
        resolve("ep=3", MOE, 3)
    with pytest.raises(UsageError, match=r"layout.ep: ep \(4\) must divide dp_shard\*cp \(2\*1\)"):
        resolve("ep=4,tp=2", MOE, 4)


def test_context_parallel_cuts_the_sequence_into_2cp_chunks_and_sp_cuts_each_rank_s_part():
    """Head-tail sharding needs seq_len / (2*cp) whole chunks; sequence parallel then
    cuts each rank's seq_len / cp tokens by tp."""
    seq36 = dataclasses.replace(TINY, seq_len=36)
    assert resolve("cp=2,tp=2,sp=1", seq36, 4).cp == 2
    with pytest.raises(UsageError, match=r"^layout.cp: seq_len \(36\) must divide by 2\*cp \(8\)"):
        resolve("cp=4", seq36, 4)
    with pytest.raises(UsageError, match=r"^layout.sp: seq_len \(36\) must divide by cp\*tp \(8\)"):
        resolve("cp=2,tp=4,sp=1", seq36, 8)


def test_tp_stays_inside_a_node():
    assert resolve("tp=4", TINY, 4, gpus_per_node=4).tp == 4
    with pytest.raises(UsageError, match=r"layout.tp: tp \(4\) must divide gpus_per_node \(2\)"):
        resolve("tp=4", TINY, 4, gpus_per_node=2)


SPACE = {"tp": [1, 2, 4], "pp": [1, 2], "zero": [0, 3], "mbs": [1, 2], "sp": [0, 1]}


def test_enumeration_count_worked_by_hand():
    # (tp, pp, dp): (1,1,4): zero 2 x mbs 2 = 4;  (1,2,2): 4;  (2,1,2): zero 2 x mbs 2 x sp 2 = 8;
    # (2,2,1): zero folds to 0 at dp=1 -> mbs 2 x sp 2 = 4;  (4,1,1): 4.  Total 24.
    layouts = enumerate_layouts(TINY, 4, SPACE)
    assert len(layouts) == 24
    assert len(set(layouts)) == 24
    assert all(layout.world_size == 4 for layout in layouts)
    # gpus_per_node=2 removes the four tp=4 layouts.
    assert len(enumerate_layouts(TINY, 4, SPACE, gpus_per_node=2)) == 20


def test_enumeration_dp_shard_values():
    # dp=4 at tp=pp=1: dp_shard in {4 ("dp"), 2, 1}; HSDP needs zero >= 1, so zero 0 only with dp_shard=dp.
    layouts = enumerate_layouts(TINY, 4, {"zero": [0, 3], "dp_shard": ["dp", 2, 1]})
    assert sorted((l.zero, l.dp_shard) for l in layouts) == [(0, 4), (3, 1), (3, 2), (3, 4)]


def test_enumeration_of_a_space_with_nothing_valid_is_empty():
    assert enumerate_layouts(TINY, 3, {"tp": [2]}) == []


def test_layout_short_form():
    assert resolve("tp=2,pp=2,zero=3,sp=1,mbs=2,recompute=full", TINY, 8).short() == \
        "tp=2 pp=2 dp=2 zero=3 1f1b sp mbs=2 rc=full"


def test_model_from_dict_rejects_bad_types():
    with pytest.raises(UsageError, match="^name: missing required field"):
        model_from_dict({"vocab_size": 1})


def test_zero3_folds_into_zero2_under_pp():
    """Under PP FSDP keeps parameters gathered through the step at zero 2 and 3 alike,
    so a search enumerates the pair once."""
    assert resolve("pp=2,zero=3", TINY, 4).canonical().zero == 2
    assert resolve("zero=3", TINY, 4).canonical().zero == 3
    assert len(enumerate_layouts(TINY, 4, {"pp": [2], "zero": [2, 3]})) == 1


def _every_combination_resolved(model, gpus, space, gpus_per_node=None):
    """The enumeration by its definition: resolve every combination of the space, keep the
    valid ones' canonical layouts, each once where it first comes (the oracle of the pruned
    enumeration)."""
    import itertools

    from autotune.plan.layout import INT_KEYS, STR_KEYS, check
    keys = [k for k in INT_KEYS + STR_KEYS if k in space and k != "dp"]
    seen = {}
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


ODD_SPACES = [
    {"zero": [0, 3], "dp_shard": ["dp", 2, 1]},
    {"pp": [1, 2], "schedule": ["zbv", "1f1b", "interleaved_1f1b"], "mbs": [1, 2]},  # vpp filled by the schedule
    {"pp": [1, 2, 4], "schedule": ["dualpipev", "zbv", "gpipe", "zero_bubble"], "vpp": [1, 2, 4],
     "recompute": ["op", "full"], "recompute_layers": [2, 0, 1]},
    {"tp": [4, 1, 2], "sp": [1, 0], "cp": [2, 1], "zero": [3, 2, 0], "pp": [2, 1], "ep": [1, 2, 4],
     "dp_shard": [1, "dp", 2], "mbs": [4, 1]},
]


@pytest.mark.parametrize("model, gpus, space, gpus_per_node", [
    *((MOE, 8, space, None) for space in ODD_SPACES),
    (TINY, 4, ODD_SPACES[3], 2),
    (TINY, 8, ODD_SPACES[3], None),
    *((MOE, 8, space, 8) for space in reasonable_space(MOE, 8, 8)),
])
def test_pruned_enumeration_equals_resolving_every_combination(model, gpus, space, gpus_per_node):
    """Same layouts, same order, as resolving each combination: the rules applied as their
    keys are chosen and the folded values skipped prune combinations, never layouts; and a
    skip that reads the state keys drops exactly the layouts it is true for, counted."""
    expected = _every_combination_resolved(model, gpus, space, gpus_per_node)
    assert enumerate_layouts(model, gpus, space, gpus_per_node) == expected
    assert expected

    from autotune.plan.layout import STATE_KEYS

    def state(layout):
        return tuple(getattr(layout, k) for k in STATE_KEYS)
    states = list(dict.fromkeys(map(state, expected)))

    def skip(layout):
        """Every other combination of the state keys, reading only them."""
        return states.index(state(layout)) % 2 == 1 if state(layout) in states else False
    kept = [layout for layout in expected if not skip(layout)]
    assert 0 < len(kept) < len(expected) or len(states) == 1
    assert enumerate_layouts_skipping(model, gpus, space, gpus_per_node, skip) == (kept, len(expected) - len(kept))


def test_enumeration_refuses_a_degree_below_one():
    with pytest.raises(UsageError, match=r"^layout.tp: must be >= 1, got 0"):
        enumerate_layouts(TINY, 4, {"tp": [1, 0]})
