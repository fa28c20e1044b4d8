"""FSDP's all-gather on the CPU returns only once gloo has let go of its output, so the
output is freed where FSDP frees it and a step's peak memory does not depend on when
gloo's worker thread runs (runtime/parallel/gloo_release.py, runtime/memory.py). torch's own
call returned with gloo's work still holding the output in 33 and 54 of 200 calls on the
two ranks of one run on two cores; the released one in none."""

from support.gloo_probe import references_after_all_gathers
from support.spawn_group import run_on_ranks


def test_the_released_all_gather_leaves_no_reference_to_its_output():
    for answer in run_on_ranks(2, references_after_all_gathers, 200, 4096):
        assert answer["right"]
        assert answer["late"]["held"] == 200, answer  # the count sees a reference the caller keeps
        assert answer["late"]["released"] == 0, answer  # torch's own call may leave one: gloo's worker
