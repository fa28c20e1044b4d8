"""The estimator: a layout's peak memory per rank and its step time, priced without launching
it. Pure Python (no torch import), so it prices thousands of layouts a second.

memory.py says which runtime behaviour each memory term mirrors, step_time.py the FLOP and
communication accounting and its overlap assumptions, pricing.py assembles them into an
Estimate, calibration.py holds the factors and fit.py fits them to measured trials, listing.py
prices every valid layout of a space. The names below are the package's public API.
"""

from autotune.estimate.calibration import Calibration, default_calibration
from autotune.estimate.fit import calibrate
from autotune.estimate.listing import every_layout, price_every_layout, rank_estimates, reasonable_space
from autotune.estimate.pricing import Estimate, budget_bytes, estimate, precision_tflops

__all__ = ["Calibration", "Estimate", "budget_bytes", "calibrate", "default_calibration", "estimate",
           "every_layout", "precision_tflops", "price_every_layout", "rank_estimates", "reasonable_space"]
