"""Samplers that only ever propose a valid layout not measured before.

Every sampler is an Optuna sampler over the same search space: one categorical
parameter per layout key that varies in the space. Each chooses a whole layout at
once (`sample_relative`) from the valid layouts that no trial has taken yet, so a
layout is never measured twice and an invalid combination is never proposed:

    grid    the space in nested order (tp outermost, as NeMo's configurator loops)
    random  uniformly among the untaken layouts
    tpe     Optuna's multivariate TPE over the keys that are free: dp follows from
            tp, pp and cp, and a drawn combination is folded onto the layout it runs
            as (keys that change nothing reset, vpp what the schedule runs, dp_shard
            = dp where the space gives no such shard group at that dp, zero 2 at pp=1
            the space's zero 3); a proposal that is still
            invalid or taken is drawn again, and after a few misses a random untaken
            layout is used
    model   the estimator's ranking, re-fitted to the measured trials before every
            proposal (the default): the layout predicted fastest among those
            predicted to fit, then the rest
"""

from __future__ import annotations

import random

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.samplers import BaseSampler, TPESampler
from optuna.trial import FrozenTrial

from autotune.plan.layout import KEYS, Layout
from autotune.plan.schedules import SCHEDULES
from autotune.record import holds_layout

TPE_ATTEMPTS = 16


def key_distributions(layouts: list[Layout]) -> dict[str, CategoricalDistribution]:
    """One categorical per layout key that takes more than one value among the layouts."""
    out = {}
    for key in KEYS:
        values = list(dict.fromkeys(getattr(layout, key) for layout in layouts))
        if len(values) > 1:
            out[key] = CategoricalDistribution(values)
    return out


def taken_layouts(study: optuna.Study) -> set[str]:
    """Layouts no new trial may take: those of every trial that holds its layout."""
    return {t.user_attrs["layout"] for t in study.get_trials(deepcopy=False) if holds_layout(t)}


class LayoutSampler(BaseSampler):
    """The shared mechanics: search space, untaken layouts, params of the chosen one."""

    def __init__(self, layouts: list[Layout], seed: int = 0):
        self.layouts = layouts
        self.by_name = {str(layout): layout for layout in layouts}
        self.distributions = key_distributions(layouts)
        self.rng = random.Random(seed)

    def untaken(self, study: optuna.Study) -> list[Layout]:
        taken = taken_layouts(study)
        return [layout for layout in self.layouts if str(layout) not in taken]

    def infer_relative_search_space(self, study, trial):
        return dict(self.distributions)

    def sample_relative(self, study, trial, search_space):
        candidates = self.untaken(study)
        if not candidates:
            return {}
        layout = self.choose(study, trial, candidates)
        return {key: getattr(layout, key) for key in self.distributions}

    def sample_independent(self, study, trial, param_name, param_distribution):
        # Only reached when every layout is taken: any value, the study stops right after.
        return param_distribution.choices[0]

    def choose(self, study: optuna.Study, trial: FrozenTrial, candidates: list[Layout]) -> Layout:
        raise NotImplementedError

    def reseed_rng(self) -> None:
        self.rng.seed()


class GridSampler(LayoutSampler):
    def choose(self, study, trial, candidates):
        return candidates[0]


class RandomSampler(LayoutSampler):
    def choose(self, study, trial, candidates):
        return self.rng.choice(candidates)


class TpeSampler(LayoutSampler):
    def __init__(self, layouts: list[Layout], seed: int = 0):
        super().__init__(layouts, seed)
        self.tpe = TPESampler(multivariate=True, seed=seed, n_startup_trials=5)
        self.free = {key: d for key, d in self.distributions.items() if key != "dp"}  # dp = gpus / (tp pp cp)
        self.draws = self.valid_draws = 0  # TPE's proposals, and those that folded onto a layout of the space
        # The shard-group sizes the space gives each data-parallel degree (a space says
        # "dp" or a size, e.g. [dp, 8]); TPE draws a size from all of them at once.
        self.shards: dict[int, set[int]] = {}
        for layout in layouts:
            self.shards.setdefault(layout.dp, set()).add(layout.dp_shard)
        self.unpiped_zeros = {layout.zero for layout in layouts if layout.pp == 1}

    def choose(self, study, trial, candidates):
        allowed = {self.params_key(layout): layout for layout in candidates}
        valid = {self.params_key(layout) for layout in self.layouts}
        for _ in range(TPE_ATTEMPTS):
            params = self.tpe.sample_relative(study, trial, self.free)
            key = self.params_key(folded) if (folded := self.fold(params)) is not None else None
            self.draws += 1
            self.valid_draws += key in valid
            if key in allowed:
                return allowed[key]
        return self.rng.choice(candidates)

    def fold(self, params: dict) -> Layout | None:
        """The layout a drawn combination runs as, or None where tp pp cp do not divide the GPUs.
        dp follows from them; a shard-group size the space does not give that dp means the
        whole of dp (no HSDP); keys that change nothing at these degrees fold (Layout.canonical)."""
        values = {key: params.get(key, getattr(self.layouts[0], key)) for key in KEYS}
        model_parallel = values["tp"] * values["pp"] * values["cp"]
        gpus = self.layouts[0].world_size
        if gpus % model_parallel:
            return None
        values["dp"] = gpus // model_parallel
        if values["dp_shard"] not in self.shards.get(values["dp"], ()):  # not a shard group of this dp in the space
            values["dp_shard"] = values["dp"]
        if values["zero"] == 2 and values["pp"] == 1 and 2 not in self.unpiped_zeros:
            values["zero"] = 3  # the space's zero 3, which Layout.canonical writes as 2 under PP
        placement = SCHEDULES[values["schedule"]].placement
        if placement != "looped":
            values["vpp"] = 2 if placement == "v" else 1
        return Layout(**values).canonical()

    def params_key(self, layout: Layout) -> tuple:
        return tuple(getattr(layout, k) for k in self.distributions)


class ModelSampler(LayoutSampler):
    """Ranks untaken layouts by `score(layout, study)`: the study supplies it, fitted to
    the trials measured so far, so the ranking improves as the sweep runs."""

    def __init__(self, layouts: list[Layout], score, seed: int = 0):
        super().__init__(layouts, seed)
        self.score = score

    def choose(self, study, trial, candidates):
        scorer = self.score(study)
        return max(candidates, key=scorer)


def layout_from_params(sampler: LayoutSampler, params: dict) -> Layout | None:
    """The valid layout whose varying keys take these values (None if there is none)."""
    for layout in sampler.layouts:
        if all(getattr(layout, k) == v for k, v in params.items()):
            return layout
    return None
