"""The sampler benchmarks' replay (benchmarks/replay.py) drives today's Controller: a few
launches of each sampler on the smallest search-efficiency scenario, so that a change of
the controller's calls (calibrate's arguments, say) breaks this test and not, unseen,
the benchmarks that take half an hour."""

import dataclasses
import sys
from pathlib import Path

import optuna
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import replay  # noqa: E402
import search_efficiency  # noqa: E402

from autotune.config import load_hardware  # noqa: E402
from autotune.plan.space import load_space, valid_layouts  # noqa: E402
from autotune.record import Question  # noqa: E402
from autotune.study import controller as study_module  # noqa: E402


@pytest.mark.parametrize("sampler", ["model", "tpe"])
def test_replay_launches_distinct_layouts_through_the_controller(monkeypatch, sampler):
    for name in ("run_trial", "RankPool", "write_csv", "valid_layouts", "calibrate"):
        monkeypatch.setattr(study_module, name, getattr(study_module, name))  # restored after the test
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    scenario = search_efficiency.SCENARIOS[0]
    model, space, hardware = scenario.model_config(), load_space(scenario.space), load_hardware("h100-sxm")
    layouts = valid_layouts(model, scenario.gpus, space, hardware.scale_up_gpus)
    driver = replay.Replay(layouts, search_efficiency.make_truth(model, layouts, hardware, 17))
    question = Question(model=dataclasses.asdict(model), gpus=scenario.gpus, space=dataclasses.asdict(space),
                        hardware=dataclasses.asdict(hardware), sampler=sampler, max_comm_fraction=0.30,
                        memory_budget_gb=hardware.memory_gb, device="cuda", seed=0,
                        gpus_per_node=hardware.gpus_per_host)
    reached, trials = driver.trials_to_target(question, float("inf"), 6)
    launched = [t.user_attrs["layout"] for t in trials if "layout" in t.user_attrs]
    assert reached is None and len(launched) == len(set(launched)) >= 6
    assert driver.calibrations, "the controller calibrated the estimator on what it measured"
