"""Where the stopping rule ends a sweep with no budget, on the search-efficiency scenarios.

    .venv/bin/python benchmarks/stopping_rule.py [--seeds 1] [--scenario NAME ...] [--cap 150]

    .venv/bin/python benchmarks/stopping_rule.py --seeds 3 --patience 5 --patience 10 --margin 0.1 --margin 0.25

The shipped controller and model sampler run against search_efficiency's seeded truth
(replay.py answers each launch) with neither --trials nor --time-budget, so the rule in
autotune/study/stopping.py decides when to stop (--cap is a safety net). Per scenario and seed:
the launches it took, and how far the best it found is from the best layout of the
truth (the regret). Prints a line each.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import optuna
from replay import NoClaim, Replay
from search_efficiency import SCENARIOS, make_truth, reportable

from autotune.config import load_hardware
from autotune.plan.space import load_space, valid_layouts
from autotune.record import Question, counts_as_launch
from autotune.study import controller as study_module
from autotune.study import stopping


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--scenario", action="append")
    parser.add_argument("--cap", type=int, default=150)
    parser.add_argument("--patience", type=int, action="append", help="values of stopping.PATIENCE to try")
    parser.add_argument("--margin", type=float, action="append", help="values of stopping.MARGIN to try")
    args = parser.parse_args()
    for patience in args.patience or [stopping.PATIENCE]:
        for margin in args.margin or [stopping.MARGIN]:
            stopping.PATIENCE, stopping.MARGIN = patience, margin
            print(f"== patience {patience}, margin {margin:.0%}", flush=True)
            run(args)


def run(args) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    hardware = load_hardware("h100-sxm")
    launched, regrets = [], []
    for scenario in SCENARIOS:
        if args.scenario and scenario.name not in args.scenario:
            continue
        model, space = scenario.model_config(), load_space(scenario.space)
        layouts = valid_layouts(model, scenario.gpus, space, hardware.scale_up_gpus)
        replay = Replay(layouts)
        max_comm = space.options.get("max_comm_fraction", 0.30)
        for seed in range(args.seeds):
            replay.records = make_truth(model, layouts, hardware, 1000 * seed + 17)
            best = max(reportable(replay.records, max_comm).values())
            question = Question(model=dataclasses.asdict(model), gpus=scenario.gpus, space=dataclasses.asdict(space),
                                hardware=dataclasses.asdict(hardware), max_comm_fraction=max_comm,
                                memory_budget_gb=hardware.memory_gb, device="cuda", seed=seed,
                                gpus_per_node=hardware.gpus_per_host)
            start = time.perf_counter()
            study = optuna.create_study(direction="maximize")
            with tempfile.TemporaryDirectory() as out:
                controller = study_module.Controller(question, study, Path(out), NoClaim())
                controller.q = dataclasses.replace(question, trials=None)
                launches = 0
                while controller.can_start(study.get_trials(deepcopy=False)) and launches < args.cap:
                    study.optimize(controller.objective, n_trials=1, catch=(study_module.TrialFailed,))
                    launches = sum(map(counts_as_launch, study.get_trials(deepcopy=False)))
            found = max((t.value for t in study.get_trials(deepcopy=False) if t.value is not None), default=0.0)
            launched.append(launches)
            regrets.append(1 - found / best)
            print(f"{scenario.name} seed {seed}: stopped after {launches} launches "
                  f"({'the rule' if controller.tally.stopped else 'the cap'}); best found {found / best:.1%} of the "
                  f"truth's best ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"   all: median {statistics.median(launched)} launches, within 2% of the best in "
          f"{sum(r <= 0.02 for r in regrets)} of {len(regrets)}, worst {max(regrets):.1%} below", flush=True)


if __name__ == "__main__":
    main()
