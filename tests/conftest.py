"""Shared set-up: one thread per rank, the `distributed` tier, the PostgreSQL fixture.

`pytest -m "not distributed"` is the fast tier (about half a minute): every test that starts
a process (a gloo process group, torchrun, the CLI in a subprocess, Chromium) is marked
`distributed` here, by module or by name. A test of the fast tier that starts one fails
and says so, so the tiers stay honest.
"""

import multiprocessing.process
import os
import subprocess

import pytest

from support.postgres import postgres_db  # noqa: F401 - a fixture

# Trials and spawned test groups run one thread per rank: ranks share the machine's cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore")

# Modules whose every test starts processes.
DISTRIBUTED_MODULES = {
    "test_kinds_numerics", "test_mla_window_numerics", "test_fp8_numerics",
    "test_cp_numerics", "test_dp_numerics", "test_ep_numerics", "test_launch", "test_memory_dp_tp",
    "test_memory_pp", "test_multinode", "test_pp_numerics", "test_reliability", "test_report_browser",
    "test_ring_attention", "test_runtime_dp", "test_study", "test_tp_numerics", "test_worker",
    "test_export_torchtitan", "test_pool", "test_spawn_group", "test_gloo_release", "test_hybrid_memory",
}
# Tests of the other modules that start processes (test_profiling's use a spawned fixture).
DISTRIBUTED_TESTS = {
    "test_estimate::test_estimate_modules_do_not_import_torch",
    "test_hybrid_numerics::test_a_hybrid_model_trains_as_one_process_under_every_dimension",
    "test_estimate::test_output_into_a_closed_pipe_exits_quietly",
    "test_metrics::test_trial_figures_follow_their_formulas",
    "test_metrics::test_cli_trial_over_a_tiny_memory_budget_is_pruned_oom_with_its_figures",
    "test_metrics::test_cli_rejects_a_bad_peak_and_an_unknown_hardware",
    "test_metrics::test_cli_trial_whose_allocation_fails_is_pruned_oom",
    "test_profiling::test_no_collectives_means_no_communication",
    "test_profiling::test_only_communicating_is_nearly_all_communication",
    "test_profiling::test_with_fixed_compute_the_fraction_rises_with_message_size",
    "test_profiling::test_waiting_for_a_late_rank_counts_as_the_others_communication",
    "test_profiling::test_gloo_event_names_are_those_documented",
    "test_profiling::test_a_receive_waiting_for_a_late_sender_is_communication",
    "test_profiling::test_communication_hidden_behind_compute_is_not_exposed",
    "test_profiling::test_a_known_extra_tensor_raises_the_peak_by_its_size",
    "test_profiling::test_a_tensor_freed_on_another_thread_is_freed_for_the_peak",
    "test_profiling::test_columns_give_the_per_event_readings_figures_on_one_real_profile",
    "test_report::test_exports_of_a_known_pipeline_layout",
    "test_report::test_exports_of_a_known_data_parallel_layout",
    "test_slurm::test_slurm_trial_runs_on_the_allocations_first_nodes",
    "test_slurm::test_slurm_timeout_cancels_the_step",
}


def pytest_collection_modifyitems(config, items):
    """Mark the distributed tier, and run the modules that start processes first: xdist hands
    out whole files in collection order, so the long ones start early and the fast tier's
    short files fill the end instead of one worker finishing a long file alone."""
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        if module in DISTRIBUTED_MODULES or f"{module}::{item.originalname}" in DISTRIBUTED_TESTS:
            item.add_marker(pytest.mark.distributed)
    starts_processes = {item.module.__name__ for item in items if item.get_closest_marker("distributed")}
    items.sort(key=lambda item: (item.module.__name__.rpartition(".")[2] not in DISTRIBUTED_MODULES,
                                 item.module.__name__ not in starts_processes))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Outside the distributed tier, starting a process (in the test or in a fixture it
    sets up) is a failure that names the test."""
    if item.get_closest_marker("distributed"):
        return (yield)

    def refuse(*args, **kwargs):
        raise AssertionError(f"{item.nodeid} starts a process: list it in DISTRIBUTED_TESTS (tests/conftest.py)")

    saved = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start
    subprocess.Popen.__init__ = multiprocessing.process.BaseProcess.start = refuse
    try:
        return (yield)
    finally:
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = saved
