"""`autotune run` / `autotune worker` with every trial replaced by a fake one.

The claim and the retry of a dead worker's trial are properties of the study, not of
the trials, so their tests run many trials in seconds this way:

    python tests/support/fake_trials.py worker --storage URL --study-name NAME

Environment: FAKE_TRIAL_S (how long a trial takes, default 0.05 s), FAKE_TRIAL_HANG
(every trial hangs: its worker is to be killed), FAKE_CHOOSE_S (the sampler takes this
long to choose, widening the window in which two workers could choose alike),
FAKE_NO_CLAIM (the claim does nothing: the control that shows the race is real).
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autotune import cli  # noqa: E402
from autotune.study import controller as study  # noqa: E402
from autotune.study import samplers, storage  # noqa: E402


def fake_run_trial(spec, nprocs, timeout_s, log_dir=None, launcher=None):
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    if os.environ.get("FAKE_TRIAL_HANG"):
        time.sleep(3600)
    time.sleep(float(os.environ.get("FAKE_TRIAL_S", "0.05")))
    return {"status": "complete", "reason": None, "tokens_per_s": 1000.0, "step_time_s": 0.1, "losses": [1.0],
            "world_size": nprocs}


def slow_choice(sample_relative, seconds):
    def sample(self, study_, trial, search_space):
        params = sample_relative(self, study_, trial, search_space)
        time.sleep(seconds)
        return params
    return sample


study.run_trial = fake_run_trial
study.RankPool = lambda: None  # no warm pool: every trial goes through the fake run_trial
if os.environ.get("FAKE_CHOOSE_S"):
    samplers.LayoutSampler.sample_relative = slow_choice(samplers.LayoutSampler.sample_relative,
                                                         float(os.environ["FAKE_CHOOSE_S"]))
if os.environ.get("FAKE_NO_CLAIM"):
    storage.Claim.acquire = storage.Claim.release = lambda self: None

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
