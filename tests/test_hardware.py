"""Hardware presets: every number present and sourced, and "inside a node" meaning the
scale-up domain (an NVL72 rack's 72 GPUs, not its hosts of 4)."""

import pytest

from autotune.config import HARDWARE_DIR, hardware_for_device_name, hardware_presets, load_hardware, load_model
from autotune.errors import UsageError
from autotune.estimate import Calibration, estimate
from autotune.plan.layout import resolve
from autotune.record import Question

GPUS = ("a100-80gb", "h100-sxm", "h200", "b200", "b300", "gb200", "gb300", "mi300x", "mi355x")
NO_LATENCY = Calibration(latency_s=0.0)


def test_every_gpu_preset_gives_its_numbers_with_sources():
    assert set(GPUS) <= set(hardware_presets())
    for name in GPUS:
        hw = load_hardware(name)
        assert hw.peak_tflops == hw.dense_tflops["bf16"]  # MFU's denominator: the dense bf16 peak
        assert {"bf16", "fp16", "fp32"} <= set(hw.dense_tflops)
        assert hw.memory_gb > 0 and hw.scale_up_gbps > hw.scale_out_gbps > 0
        assert "https://" in (HARDWARE_DIR / f"{name}.yaml").read_text(), f"{name}: no source"


def test_precisions_by_generation():
    assert "fp8" not in load_hardware("a100-80gb").dense_tflops
    for name in ("h100-sxm", "h200", "mi300x"):  # fp8 without MX block scales
        hw = load_hardware(name)
        assert hw.matmul_tflops("fp8") == pytest.approx(2 * hw.peak_tflops, rel=1e-3)
        assert "mxfp8" not in hw.dense_tflops
    for name in ("b200", "b300", "gb200", "gb300", "mi355x"):
        hw = load_hardware(name)
        assert hw.matmul_tflops("mxfp8") == hw.matmul_tflops("fp8") == pytest.approx(2 * hw.peak_tflops, rel=1e-3)
    with pytest.raises(UsageError, match=r"^dtype: a100-80gb has no fp8 \(it has bf16, fp16, tf32, fp32\)$"):
        load_hardware("a100-80gb").matmul_tflops("fp8")


def test_nvl72_is_hosts_of_four_in_a_domain_of_72():
    for name in ("gb200", "gb300"):
        hw = load_hardware(name)
        assert (hw.gpus_per_host, hw.scale_up_gpus) == (4, 72)
        # --gpus-per-node changes the hosts, not the rack's NVLink domain; on an HGX it is both.
        assert hw.with_gpus_per_host(2).scale_up_gpus == 72
    assert load_hardware("h100-sxm").with_gpus_per_host(4).scale_up_gpus == 4


def test_device_names():
    assert hardware_for_device_name("NVIDIA GB200").name == "gb200"
    assert hardware_for_device_name("NVIDIA B200").name == "b200"
    assert hardware_for_device_name("NVIDIA GB300").name == "gb300"
    assert hardware_for_device_name("AMD Instinct MI300X").name == "mi300x"
    assert hardware_for_device_name("AMD Instinct MI355X").name == "mi355x"


def test_tensor_parallel_across_hosts_stays_on_nvlink_in_an_nvl72_rack():
    """TP 8 spans two GB200 hosts of 4, yet its ring runs on NVLink: the same TP time as with
    one domain per host of 8, where on hosts of 4 without a rack domain it would cross NICs."""
    model = load_model("llama3-70b")
    layout = resolve("tp=8,dp=8", model, 64, load_hardware("gb200").scale_up_gpus)
    rack = load_hardware("gb200")
    hosts_only = rack.with_gpus_per_host(4)  # the rack's domain kept
    split = type(rack)(**{**rack.__dict__, "scale_up_gpus": 4})  # a cluster of 4-GPU NVLink islands
    on_nvlink = estimate(model, layout, rack, calibration=NO_LATENCY).comm_s["tp"]
    assert estimate(model, layout, hosts_only, calibration=NO_LATENCY).comm_s["tp"] == on_nvlink
    islands = estimate(model, layout, split, calibration=NO_LATENCY).comm_s["tp"]
    assert islands / on_nvlink == pytest.approx(rack.scale_up_gbps / (4 * rack.scale_out_gbps))


def test_layout_rule_and_report_use_the_domain():
    model = load_model("llama3-70b")
    gb200 = load_hardware("gb200")
    assert resolve("tp=8", model, 8, gb200.scale_up_gpus).tp == 8  # two hosts of 4, one NVLink domain
    with pytest.raises(UsageError, match=r"scale-up domain of 4 GPUs"):
        resolve("tp=8", model, 8, 4)
    q = Question(model={"name": "m"}, gpus=144, space={}, hardware=gb200.__dict__, gpus_per_node=4)
    assert (q.per_node, q.scale_up) == (4, 72)
    # A study stored before scale-up domains: its hardware's old names still load.
    old = Question(model={"name": "m"}, gpus=16, space={}, hardware={
        "name": "h100-sxm", "peak_tflops": 989, "memory_gb": 80, "gpus_per_node": 8, "intra_node_gbps": 450,
        "inter_node_gbps": 50})
    assert (old.per_node, old.scale_up, old.hardware_config.scale_out_gbps) == (8, 8, 50)


def test_fitted_efficiency_is_the_prior_where_a_preset_has_none():
    """A preset's compute_efficiency (fitted to published runs) is what `estimate` prices with
    by default: bf16 all the compute; fp8 and mxfp8 the 8-bit linears, the rest at the bf16
    fraction (or the prior where there is none)."""
    from autotune.estimate import default_calibration
    prior = default_calibration("cuda")
    gb200 = load_hardware("gb200")
    bf16, eight = gb200.compute_efficiency["bf16"], gb200.compute_efficiency["fp8"]
    assert default_calibration("cuda", gb200, "bf16").compute_efficiency == bf16
    fp8 = default_calibration("cuda", gb200, "fp8")
    assert (fp8.compute_efficiency, fp8.compute_efficiency * fp8.linear_8bit_efficiency) == pytest.approx((bf16, eight))
    h100 = load_hardware("h100-sxm")
    assert "bf16" not in h100.compute_efficiency
    assert default_calibration("cuda", h100, "bf16") == prior
    assert default_calibration("cuda", h100, "fp8").compute_efficiency == prior.compute_efficiency
    assert default_calibration("cpu", gb200, "bf16") == default_calibration("cpu")  # the CPU runtime's own prior
    model = load_model("tiny")
    layout = resolve("dp=8", model, 8, 8)
    by_default = estimate(model, layout, gb200, dtype="bf16").step_time_s
    assert by_default == estimate(model, layout, gb200, calibration=default_calibration("cuda", gb200, "bf16"),
                                  dtype="bf16").step_time_s
    assert by_default < estimate(model, layout, gb200, calibration=prior, dtype="bf16").step_time_s


@pytest.mark.parametrize("value, problem", [
    ({"bf17": 0.5}, r"^compute_efficiency.bf17: unknown precision \(known: bf16, "),
    ({"bf16": 1.5}, r"^compute_efficiency.bf16: must be a number in \(0, 1\], got 1.5$"),
    ({"fp8": 0}, r"^compute_efficiency.fp8: must be a number in \(0, 1\], got 0$"),
    ([0.5], r"^compute_efficiency: must be a mapping of precision: fraction, got list$"),
])
def test_a_bad_compute_efficiency_is_refused_in_one_line(value, problem):
    from autotune.config import hardware_from_dict
    data = {"name": "x", "peak_tflops": 100, "memory_gb": 80, "gpus_per_host": 8, "scale_up_gbps": 400,
            "scale_out_gbps": 50, "compute_efficiency": value}
    with pytest.raises(UsageError, match=problem):
        hardware_from_dict(data)
