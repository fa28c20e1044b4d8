"""How many of TPE's proposals are layouts of the space, on the search-efficiency scenarios.

    .venv/bin/python benchmarks/tpe_draws.py [--trials 60] [--seeds 2]

TPE (samplers.TpeSampler) draws every free layout key on its own; a draw that is not a
valid layout of the space is drawn again. Each scenario runs the shipped controller
with launches answered from search_efficiency's seeded truth (replay.py) for --trials
launches, and counts the draws that folded onto a valid layout. Prints a line per
scenario and seed; a minute or two on two cores.
"""

from __future__ import annotations

import argparse
import dataclasses

import optuna
from replay import Replay
from search_efficiency import SCENARIOS, make_truth

from autotune.config import load_hardware
from autotune.plan.space import load_space, valid_layouts
from autotune.record import Question
from autotune.study import controller as study_module

SAMPLERS: list = []  # the sampler of each study the controller builds
_make_sampler = study_module.make_sampler


def keeping_the_sampler(*args, **kwargs):
    sampler = _make_sampler(*args, **kwargs)
    SAMPLERS.append(sampler)
    return sampler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    hardware = load_hardware("h100-sxm")
    total_draws = total_valid = 0
    for scenario in SCENARIOS:
        model, space = scenario.model_config(), load_space(scenario.space)
        layouts = valid_layouts(model, scenario.gpus, space, hardware.scale_up_gpus)
        replay = Replay(layouts)
        for seed in range(args.seeds):
            replay.records = make_truth(model, layouts, hardware, 1000 * seed + 17)
            question = Question(model=dataclasses.asdict(model), gpus=scenario.gpus, space=dataclasses.asdict(space),
                                hardware=dataclasses.asdict(hardware), sampler="tpe",
                                max_comm_fraction=space.options.get("max_comm_fraction", 0.30),
                                memory_budget_gb=hardware.memory_gb, device="cuda", seed=seed,
                                gpus_per_node=hardware.gpus_per_host)
            study_module.make_sampler = keeping_the_sampler
            replay.trials_to_target(question, float("inf"), args.trials)
            sampler = SAMPLERS[-1]
            total_draws += sampler.draws
            total_valid += sampler.valid_draws
            print(f"{scenario.name} seed {seed}: {len(layouts)} layouts, {sampler.valid_draws} of {sampler.draws} "
                  f"draws valid ({sampler.valid_draws / max(1, sampler.draws):.0%})", flush=True)
    print(f"all: {total_valid} of {total_draws} draws valid ({total_valid / max(1, total_draws):.0%})")


if __name__ == "__main__":
    main()
