"""The published-runs check (benchmarks/published_runs.py): the presets' fitted compute
efficiencies are the fit the script derives from the rows it keeps for fitting, and the
rows it holds out come within its target."""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import published_runs  # noqa: E402


def rows_with_tokens():
    return [r for r in published_runs.load_rows() if r["ran"] == "1" and r["source_tokens_per_s_per_gpu"]]


def test_presets_hold_the_fitted_efficiencies_and_held_out_rows_come_within_the_target():
    rows = rows_with_tokens()
    fit, held = published_runs.split_for_fitting(rows)
    assert len(held) >= 20 and not {r["id"] for r in fit} & {r["id"] for r in held}
    efficiencies = published_runs.fitted_efficiencies(rows)
    assert published_runs.stale_presets(efficiencies) == []
    for row in fit + held:  # each priced as `autotune estimate` prices it by default: the preset's figure
        if row["hardware"] in published_runs.PRESET_FITTED:
            by_preset = published_runs.price(row).tokens_per_s_per_gpu
            by_fit = published_runs.price(row, published_runs.group_efficiencies(row, efficiencies))
            assert by_preset == by_fit.tokens_per_s_per_gpu, row["id"]
    fitted = {r["id"]: published_runs.group_efficiencies(r, efficiencies) for r in held}
    errors = [published_runs.tokens_error(r, published_runs.price(r, fitted[r["id"]])) for r in held]
    assert statistics.median(abs(e) for e in errors) <= published_runs.TOKENS_TARGET
