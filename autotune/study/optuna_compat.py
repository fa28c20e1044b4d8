"""Every private Optuna API the controller uses, in one place, so an Optuna upgrade
mends this file and nothing else.

Optuna 5 has heartbeats for RDB storages only; `JournalHeartbeatStorage` adds them to
the journal in Optuna's own terms (a trial system attribute holding the worker's
clock), through its private heartbeat interface, so that the same `fail_stale_trials`
and retry callback serve both storages.
"""

from __future__ import annotations

import time

import optuna
from optuna.storages import JournalStorage
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.trial import TrialState

HEARTBEAT_ATTR = "heartbeat"  # journal storage: the wall-clock time of a trial's last beat


class JournalHeartbeatStorage(JournalStorage, BaseHeartbeat):
    """JournalStorage with Optuna's heartbeat interface.

    A beat is the worker's wall-clock time in the trial's system attribute `heartbeat`:
    the workers' clocks must agree to well within the grace period (NTP does). A trial
    that has not beaten yet is not stale (as in RDBStorage)."""

    def __init__(self, backend, heartbeat_interval: int, grace_period: int, heartbeat_stale_trial_callback=None):
        super().__init__(backend)
        self.heartbeat_interval = heartbeat_interval
        self.grace_period = grace_period
        self.stale_callback = heartbeat_stale_trial_callback

    def record_heartbeat(self, trial_id: int) -> None:
        try:
            self.set_trial_system_attr(trial_id, HEARTBEAT_ATTR, time.time())
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another worker found it stale and failed it; the trial's own end says so

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        now = time.time()
        return [t._trial_id for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,))
                if now - t.system_attrs.get(HEARTBEAT_ATTR, now) > self.grace_period]

    def get_heartbeat_interval(self) -> int | None:
        return self.heartbeat_interval

    def get_heartbeat_stale_trial_callback(self):
        return self.stale_callback
