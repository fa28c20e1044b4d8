"""Search spaces and samplers: only valid layouts, never one twice, in each sampler's order."""

import optuna
import pytest
from optuna.trial import TrialState

from autotune.config import load_model
from autotune.errors import UsageError
from autotune.plan.space import load_space, space_from_dict, space_names, valid_layouts
from autotune.study.samplers import GridSampler, ModelSampler, RandomSampler, TpeSampler, layout_from_params

TINY = load_model("tiny")


def test_shipped_spaces_load():
    assert {"default", "dense", "moe", "long_context", "quick"} <= set(space_names())
    for name in space_names():
        space = load_space(name)
        assert space.values
        # the CPU demo space tolerates gloo's waits on shared cores; the others prune at 30%
        assert space.options.get("max_comm_fraction") == (0.90 if name == "quick" else 0.30)
    # quick on 4 GPUs: 12 layouts without PP, 8 with (zero 0/2 or tp 2 with sp 0/1, mbs 1/2)
    assert len(valid_layouts(TINY, 4, load_space("quick"))) == 20


def test_default_and_long_context_spaces_search_context_parallel():
    """tiny on 8 GPUs: cp up to 4 in the default space, up to 8 (seq 64 / 2*8 = 4-token
    chunks) in long_context, alone and with tp and sp."""
    default, long_context = (valid_layouts(TINY, 8, load_space(name)) for name in ("default", "long_context"))
    assert {layout.cp for layout in default} == {1, 2, 4}
    assert {layout.cp for layout in long_context} == {1, 2, 4, 8}
    assert any(layout.cp > 1 and layout.tp > 1 and layout.sp for layout in long_context)


@pytest.mark.parametrize("space", ["moe", "default"])
def test_moe_and_default_spaces_search_expert_parallel(space):
    """For an MoE model both offer every ep that divides the experts and dp_shard x cp;
    a dense model never gets ep > 1."""
    for model, gpus in (("tiny-moe", 4), ("mixtral-8x7b", 8)):
        degrees = {layout.ep for layout in valid_layouts(load_model(model), gpus, load_space(space), 8)}
        assert degrees == {e for e in (1, 2, 4, 8) if e <= gpus}, (model, degrees)
    assert {layout.ep for layout in valid_layouts(TINY, 4, load_space(space))} == {1}


@pytest.mark.parametrize("data, message", [
    ({"layout": {"tp": [1, 2], "colour": [1]}}, "space.layout.colour: unknown layout key"),
    ({"layout": {"dp": [2]}}, "space.layout.dp: dp is derived"),
    ({"layout": {"tp": ["two"]}}, "space.layout.tp: values must be integers, got 'two'"),
    ({"layout": {"recompute": [1]}}, "space.layout.recompute: values must be strings"),
    ({"layout": {"tp": []}}, "space.layout.tp: must list at least one value"),
    ({"layout": {"tp": [1]}, "options": {"speed": 1}}, "space.options.speed: unknown option"),
    ({"layout": {"tp": [1]}, "extra": 1}, "space.extra: unknown section"),
    ({"options": {}}, "space.layout: must be a mapping"),
])
def test_space_errors_name_the_field(data, message):
    with pytest.raises(UsageError, match="^" + message.replace(".", r"\.")):
        space_from_dict(data, "s")


def test_space_with_no_valid_layout_is_bad_input(tmp_path):
    path = tmp_path / "odd.yaml"
    path.write_text("layout:\n  tp: [3]\n")
    with pytest.raises(UsageError, match="space odd: no valid layout for tiny on 4 GPUs"):
        valid_layouts(TINY, 4, load_space(str(path)))
    with pytest.raises(UsageError, match="space: unknown search space 'nope'"):
        load_space("nope")


def sweep(sampler, n_trials=None, score=lambda layout: 0.0):
    """Run a study whose objective records the proposed layout, as the controller does."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    proposed = []

    def objective(trial):
        params = {k: trial.suggest_categorical(k, d.choices) for k, d in sampler.distributions.items()}
        layout = layout_from_params(sampler, params)
        trial.set_user_attr("layout", str(layout))
        trial.set_user_attr("status", "complete")
        proposed.append(layout)
        return score(layout)

    def stop(study, trial):
        if not sampler.untaken(study):
            study.stop()
    study.optimize(objective, n_trials=n_trials, callbacks=[stop])
    return study, proposed


LAYOUTS = valid_layouts(TINY, 4, load_space("quick"))


def test_grid_runs_the_space_in_nested_order_once():
    _, proposed = sweep(GridSampler(LAYOUTS))
    assert proposed == LAYOUTS  # every layout, once, tp outermost


@pytest.mark.parametrize("make", [lambda: RandomSampler(LAYOUTS, seed=3), lambda: TpeSampler(LAYOUTS, seed=3)])
def test_random_and_tpe_propose_each_valid_layout_once(make):
    _, proposed = sweep(make())
    assert sorted(map(str, proposed)) == sorted(map(str, LAYOUTS))


def test_tpe_folds_a_draw_onto_the_layout_it_runs_as():
    """TPE draws each key on its own; a draw is folded onto the space's layout it names:
    dp follows from tp pp cp, a shard-group size the space does not give that dp is the
    whole of dp, zero 2 at pp=1 is the space's zero 3 (which PP layouts record as 2), and
    keys that change nothing (sp at tp=1) reset."""
    space = space_from_dict({"layout": {"tp": [1, 2], "pp": [1, 2], "zero": [1, 3],
                                        "dp_shard": ["dp", 2], "sp": [0, 1]}}, "hsdp")
    layouts = valid_layouts(TINY, 8, space)
    sampler = TpeSampler(layouts)
    base = {"tp": 1, "pp": 1, "cp": 1, "zero": 3, "dp_shard": 8, "sp": 0}
    assert str(sampler.fold(base)) == str(next(l for l in layouts if (l.dp, l.dp_shard, l.zero) == (8, 8, 3)))
    hsdp = sampler.fold(base | {"dp_shard": 2})
    assert (hsdp.dp, hsdp.dp_shard) == (8, 2) and hsdp in layouts
    not_a_group = sampler.fold(base | {"tp": 2, "dp_shard": 8})  # dp is 4: no group of 8
    assert (not_a_group.dp, not_a_group.dp_shard) == (4, 4) and not_a_group in layouts
    assert sampler.fold(base | {"zero": 2}).zero == 3
    assert sampler.fold(base | {"pp": 2, "zero": 2}).zero == 2
    assert sampler.fold(base | {"sp": 1}).sp == 0
    assert sampler.fold(base | {"tp": 3}) is None  # 3 does not divide 8 GPUs


def test_model_sampler_follows_its_score():
    throughput = {str(layout): (i * 7919) % 101 for i, layout in enumerate(LAYOUTS)}
    sampler = ModelSampler(LAYOUTS, score=lambda study: lambda layout: throughput[str(layout)])
    _, proposed = sweep(sampler, n_trials=5)
    assert [throughput[str(l)] for l in proposed] == sorted(throughput.values(), reverse=True)[:5]


def test_interrupted_and_abandoned_trials_give_their_layout_back():
    sampler = GridSampler(LAYOUTS)
    study, proposed = sweep(sampler, n_trials=3)
    assert len(sampler.untaken(study)) == len(LAYOUTS) - 3
    # A trial that died with its controller: FAIL with no status of its own.
    trial = study.ask()
    trial.set_user_attr("layout", str(LAYOUTS[-1]))
    assert len(sampler.untaken(study)) == len(LAYOUTS) - 4  # RUNNING: taken
    study.tell(trial, state=TrialState.FAIL)
    assert len(sampler.untaken(study)) == len(LAYOUTS) - 3
    # Ctrl-C: failed/interrupted, also given back; a crash keeps its layout.
    for reason, given_back in (("interrupted", True), ("crash", False)):
        trial = study.ask()
        trial.set_user_attr("layout", str(LAYOUTS[-1]))
        trial.set_user_attr("status", "failed")
        trial.set_user_attr("reason", reason)
        study.tell(trial, state=TrialState.FAIL)
        assert (str(LAYOUTS[-1]) in map(str, sampler.untaken(study))) == given_back
