"""Reports: trials.csv, report.html, best/ and `autotune report`, on studies built in a tmp folder."""

import html
import json
import re
import subprocess

import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState, create_trial

from autotune.cli import main
from autotune.config import GIB as GB
from autotune.config import load_model
from autotune.plan.layout import Layout, parse_layout, resolve
from autotune.plan.space import load_space, valid_layouts
from autotune.record import Question
from autotune.report import write_reports
from autotune.report.answer import answer
from autotune.report.best import exports, write_best
from autotune.report.html import gpu_split
from autotune.report.table import trial_table
from autotune.trialspec import TrialSpec
from support.report_study import OUTCOMES, make_study, question

# The CSV's columns are a contract (README, "Results"): written out here, not imported.
CSV_COLUMNS = ["trial", "status", "reason", "tp", "pp", "cp", "ep", "dp", "dp_shard", "zero", "mbs", "schedule",
               "vpp", "recompute", "sp", "recompute_layers", "grad_accum", "tokens_per_s", "tokens_per_s_per_gpu",
               "mfu", "step_time_s", "step_time_min_s", "step_time_max_s", "confirmed",
               "peak_mem_gb", "predicted_peak_mem_gb", "comm_fraction", "exposed_comm_fraction",
               "predicted_tokens_per_s", "duration_s", "error"]


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("study")
    study = make_study(folder)
    write_reports(study, folder)
    return folder, study


def test_csv_has_one_row_per_trial_in_every_state(study_dir):
    folder, study = study_dir
    frame = pd.read_csv(folder / "trials.csv")
    assert list(frame.columns) == CSV_COLUMNS
    assert len(frame) == len(study.trials)
    outcomes = set(frame["status"] + frame["reason"].fillna("").map(lambda r: f"/{r}" if r else ""))
    assert outcomes == set(OUTCOMES)
    for t in study.trials:
        row = frame[frame["trial"] == t.number].iloc[0]
        assert row["status"] == t.user_attrs["status"]
        layout = parse_layout(t.user_attrs["layout"])
        assert {k: row[k] for k in layout} == layout
        if "peak_mem_bytes" in t.user_attrs:
            assert row["peak_mem_gb"] == pytest.approx(t.user_attrs["peak_mem_bytes"] / GB)
        else:
            assert pd.isna(row["peak_mem_gb"])
        assert row["predicted_peak_mem_gb"] == pytest.approx(t.user_attrs["predicted_peak_mem_bytes"] / GB)
        if t.state == TrialState.COMPLETE:
            assert row["tokens_per_s"] == pytest.approx(t.value)


def test_report_is_one_offline_file_with_every_section(study_dir):
    folder, study = study_dir
    page = (folder / "report.html").read_text()
    # plotly.js is inside; nothing is fetched: no external script, stylesheet or image.
    assert "plotly.js v" in page and len(page) > 3_000_000
    assert not re.search(r"<(script|link|img)[^>]+(src|href)\s*=\s*['\"]?(https?:)?//", page)
    for anchor in ("question", "answer", "ranking", "charts", "pruned"):
        assert f"<section id='{anchor}'>" in page
    for chart in ("throughput", "memory", "comm", "predicted", "history", "importance"):
        assert f"id='chart-{chart}'" in page and f"chart-{chart}-plot" in page
    best = max((t for t in study.trials if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    assert html.escape(best.user_attrs["layout_short"]) in page.split("<section id='answer'>")[1][:3000]
    ranking = page.split("<table id='ranking'")[1].split("</table>")[0]
    assert ranking.count("<tr") == 1 + sum(t.state == TrialState.COMPLETE for t in study.trials)
    pruned = page.split("<table id='pruned'")[1].split("</table>")[0]
    assert pruned.count("<tr") == 1 + sum(t.state != TrialState.COMPLETE for t in study.trials)


def test_strings_from_the_user_and_trials_render_as_text(tmp_path):
    name = "<script>alert(1)</script>"
    study = make_study(tmp_path, model_name=name)
    write_reports(study, tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert name not in page and "alert('stderr')</script>" not in page
    assert html.escape(name) in page and html.escape("<script>alert('stderr')</script>") in page
    # Our own scripts only: the plotly bundle, one per chart, and the table sorter.
    assert page.count("<script") == 2 + page.count("Plotly.newPlot(")


def test_answer_explains_with_the_rules_of_thumb(tmp_path):
    q = question("llama3-8b", 16, "dense", "h100-sxm")
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", direction="maximize")
    study.set_user_attr("question", q)

    def add(layout, status, reason=None, tokens=None, peak=None, exposed=None):
        L = resolve(layout, load_model("llama3-8b"), 16, 8)
        attrs = {"layout": str(L), "layout_short": L.short(), "status": status, "grad_accum": L.grad_accum(
            load_model("llama3-8b")), "predicted_peak_mem_bytes": 60 * GB, "predicted_tokens_per_s": 1e5}
        if reason:
            attrs["reason"] = reason
        if tokens:
            attrs.update(tokens_per_s=tokens, peak_mem_bytes=peak * GB, exposed_comm_fraction=exposed,
                         comm_fraction=exposed + 0.2)
        state = {"complete": TrialState.COMPLETE, "pruned": TrialState.PRUNED}[status]
        study.add_trial(create_trial(state=state, value=tokens if status == "complete" else None, user_attrs=attrs))

    add("tp=2,pp=2,mbs=1,zero=1,recompute=full", "complete", tokens=100_000, peak=70, exposed=0.10)
    add("tp=2,pp=2,mbs=1,zero=1", "pruned", "oom", tokens=110_000, peak=85, exposed=0.10)
    add("tp=4,pp=1,mbs=1,zero=1", "complete", tokens=97_000, peak=40, exposed=0.35)
    result = answer(Question.from_dict(q), trial_table(study))
    assert result.best["trial"] == 0 and result.runner_up["trial"] == 2
    rules = {r.title: r for r in result.rules}
    assert rules["Tensor parallel inside a node"].verdict == "confirms"
    # 512 sequences / (mbs 1 x dp 4) = 128 micro-batches >= 4 x PP: bubble (1)/(128+1) < 1%.
    assert rules["Pipeline bubble"].verdict == "confirms" and "= 1%" in rules["Pipeline bubble"].text
    assert rules["Communication share"].verdict == "confirms" and "10%" in rules["Communication share"].text
    assert rules["Memory headroom"].verdict == "breaks" and "12% headroom" in rules["Memory headroom"].text
    assert rules["Activation recompute"].verdict == "confirms" and "pruned/oom" in rules["Activation recompute"].text
    assert "3.0% slower" in result.runner_up_text and "30.00 GiB less" in result.runner_up_text
    assert "safer choice" in result.runner_up_text  # 50% headroom for 3% of the throughput
    tp = [c for c in result.choices if c.key == "tp"]
    assert [(c.value, c.chosen) for c in tp] == [(2, True), (4, False)] and tp[1].vs_best == pytest.approx(-0.03)


def test_a_remeasured_trial_reads_as_the_median_of_its_runs_and_ties_are_called(tmp_path):
    q = question("llama3-8b", 16, "dense", "h100-sxm")
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", direction="maximize")
    study.set_user_attr("question", q)

    def add(layout, tokens, steps):
        L = resolve(layout, load_model("llama3-8b"), 16, 8)
        attrs = {"layout": str(L), "layout_short": L.short(), "status": "complete", "tokens_per_s": tokens,
                 "step_time_s": sorted(steps)[len(steps) // 2], "step_times_s": steps, "peak_mem_bytes": 40 * GB,
                 "predicted_peak_mem_bytes": 40 * GB, "grad_accum": 1}
        study.add_trial(create_trial(state=TrialState.COMPLETE, value=tokens, user_attrs=attrs))

    add("tp=2,pp=2,mbs=1,zero=1", 110_000, [1.00, 1.02, 1.01])
    add("tp=4,pp=1,mbs=1,zero=1", 100_000, [1.08, 1.10, 1.09])
    table = trial_table(study)
    assert list(table["confirmed"]) == [0, 0]
    assert list(table["step_time_min_s"]) == [1.00, 1.08] and list(table["step_time_max_s"]) == [1.02, 1.10]
    clear = answer(Question.from_dict(q), table).runner_up_text
    assert "Every measured step of the recommended layout was faster" in clear
    # trial 0 measured again, slower twice: its figures become the median of its three runs
    study.set_user_attr("remeasured", {"0": [
        {"tokens_per_s": 95_000, "step_time_s": 1.12, "step_times_s": [1.11, 1.12, 1.13], "peak_mem_bytes": 41 * GB},
        {"tokens_per_s": 104_000, "step_time_s": 1.05, "step_times_s": [1.04, 1.05, 1.07], "peak_mem_bytes": 42 * GB}]})
    table = trial_table(study)
    first = table.iloc[0]
    assert first["confirmed"] == 1 and first["value"] == first["tokens_per_s"] == 104_000
    assert first["step_time_s"] == 1.05 and first["peak_mem_gb"] == pytest.approx(41)
    assert (first["step_time_min_s"], first["step_time_max_s"]) == (1.00, 1.13)
    result = answer(Question.from_dict(q), table)
    assert result.best["trial"] == 0 and result.runner_up["trial"] == 1
    assert "within each other's spread" in result.runner_up_text and "1-1.13 s against 1.08-1.1 s" in \
        result.runner_up_text


def test_the_gpu_split_reads_both_ways():
    moe = pd.Series({"tp": 2, "pp": 1, "cp": 1, "ep": 4, "dp": 8, "dp_shard": 8})
    assert gpu_split(moe) == ("GPUs = PP × DP × CP × TP = 1 × 8 × 1 × 2 = 16; for the experts, "
                              "TP × PP × CP × EP × DP_expert = 2 × 1 × 1 × 4 × 2 (DP_expert = DP / EP)")
    assert "carved from dp_shard × cp = 2 × 2" in gpu_split(
        pd.Series({"tp": 1, "pp": 2, "cp": 2, "ep": 4, "dp": 2, "dp_shard": 2}))


def known_question(gpus=16):
    return Question.from_dict(question("llama3-8b", gpus, "dense", "h100-sxm"))


def best_row(layout: str, trial: int = 7) -> pd.Series:
    return pd.Series({"trial": trial, "layout": layout, "tokens_per_s": 1.0e5, "mfu": 0.41, "step_time_s": 41.9,
                      "peak_mem_gb": 61.0, "exposed_comm_fraction": 0.08})


def megatron_args(path) -> list[str]:
    """The array as bash sees it: the file is valid bash and the flags are what bash passes on."""
    out = subprocess.run(["bash", "-c", f"source {path} && printf '%s\\n' \"${{MEGATRON_PARALLEL_ARGS[@]}}\""],
                         capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def test_exports_of_a_known_pipeline_layout(tmp_path):
    layout = "tp=2,pp=2,cp=1,ep=1,dp=4,dp_shard=2,zero=1,mbs=1,schedule=interleaved_1f1b,vpp=2,recompute=full,sp=1"
    write_best(tmp_path, known_question(), best_row(layout))
    assert megatron_args(tmp_path / "megatron_args.sh") == [
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
        # llama3-8b's 4 stages hold 7, 9, 9, 7 layers: the embedding and head weigh 1.84 layers each.
        "--pipeline-model-parallel-layout", "Et*7|t*9|t*9|t*7L", "--context-parallel-size", "1",
        "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
        "--overlap-grad-reduce", "--overlap-param-gather",
        "--micro-batch-size", "1", "--global-batch-size", "512", "--seq-length", "8192",
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1", "--bf16"]
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in (tmp_path / "megatron_args.sh").read_text()
    titan = (tmp_path / "torchtitan.sh").read_text()
    assert "--parallelism.pipeline-parallel-schedule Interleaved1F1B" in titan
    assert "--training.local-batch-size 128" in titan and "activation-checkpoint:full" in titan
    assert re.search(r"Approximately.*\n#\s+dp=4, dp_shard=2, zero=1 -> .*no optimizer-only sharding", titan)
    # DeepSpeed cannot express a pipeline in its config: not written, and the README says why.
    assert not (tmp_path / "deepspeed.json").exists()
    assert "deepspeed.json | not written: pipeline parallel" in (tmp_path / "README.md").read_text()
    assert (tmp_path / "layout.txt").read_text().splitlines()[0] == layout
    script = (tmp_path / "torchrun.sh").read_text()
    subprocess.run(["bash", "-n", str(tmp_path / "torchrun.sh")], check=True)
    assert "--nproc-per-node=8" in script and "--nnodes=2" in script and "-m autotune.runtime.trial" in script
    spec = TrialSpec.from_json(re.search(r"--spec '(.*)'", script).group(1))
    assert spec.layout == layout and spec.model["name"] == "llama3-8b" and spec.device == "cuda"


def test_exports_of_a_known_data_parallel_layout(tmp_path):
    layout = "tp=1,pp=1,cp=1,ep=1,dp=16,dp_shard=8,zero=3,mbs=2,schedule=1f1b,vpp=1,recompute=selective,sp=0"
    write_best(tmp_path, known_question(), best_row(layout))
    assert json.loads((tmp_path / "deepspeed.json").read_text()) == {
        "train_batch_size": 512, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 16,
        "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
        "communication_data_type": "fp32"}  # the runtime's default: gradients reduced in fp32
    notes = (tmp_path / "deepspeed_notes.md").read_text()
    assert "No equivalent here" in notes and "recompute=selective" in notes.split("No equivalent here")[1]
    args = megatron_args(tmp_path / "megatron_args.sh")
    assert args[args.index("--data-parallel-sharding-strategy") + 1] == "optim_grads_params"
    assert "--use-megatron-fsdp" in args and args[args.index("--recompute-granularity") + 1] == "selective"
    titan = (tmp_path / "torchtitan.sh").read_text()
    assert "--parallelism.data-parallel-shard-degree 8" in titan
    assert "--parallelism.data-parallel-replicate-degree 2" in titan
    assert "--parallelism.fsdp-reshard-after-forward always" in titan
    assert "--training.local-batch-size 2" in titan  # torchtitan accumulates 512 / (2 x 16) = 16 steps
    assert "activation-checkpoint:selective" in titan


@pytest.mark.parametrize("model, space", [("llama3-8b", "dense"), ("mixtral-8x7b", "moe")])
def test_every_layout_of_a_space_exports(model, space):
    q = Question.from_dict(question(model, 16, space, "h100-sxm"))
    layouts = valid_layouts(load_model(model), 16, load_space(space), 8)
    for layout in layouts:
        megatron, titan, deepspeed = exports(q, str(layout))
        assert megatron.content is None and "micro-batches" in megatron.reason or (
            f"--tensor-model-parallel-size {layout.tp}" in megatron.content)
        args = dict(zip(titan.args, titan.args[1:]))
        assert (args["--parallelism.tensor-parallel-degree"], args["--parallelism.pipeline-parallel-degree"],
                args["--parallelism.context-parallel-degree"]) == (str(layout.tp), str(layout.pp), str(layout.cp))
        if deepspeed.content is not None:
            assert json.loads(deepspeed.content)["zero_optimization"]["stage"] == layout.zero
        else:
            assert layout.pp > 1 or layout.cp > 1
        for x in (megatron, titan, deepspeed):
            assert all(m.status in ("exact", "approximate", "none") for m in x.mappings)


def test_report_command_regenerates_the_files(tmp_path, capsys):
    make_study(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    for name in ("trials.csv", "report.html", "best/README.md", "best/layout.txt", "best/torchrun.sh",
                 "best/megatron_args.sh", "best/torchtitan.sh", "best/model.yaml"):
        assert (tmp_path / name).stat().st_size > 0, name
    frame = pd.read_csv(tmp_path / "trials.csv")
    best = frame[frame["status"] == "complete"].sort_values("tokens_per_s").iloc[-1]
    layout = (tmp_path / "best/layout.txt").read_text().splitlines()[0]
    assert Layout(**parse_layout(layout)).short() in (tmp_path / "report.html").read_text()
    assert parse_layout(layout)["tp"] == best["tp"] and parse_layout(layout)["mbs"] == best["mbs"]
    # Regenerated, not merely left there: a removed file comes back.
    (tmp_path / "report.html").unlink()
    assert main(["report", str(tmp_path), "--storage", f"sqlite:///{tmp_path / 'study.db'}",
                 "--study-name", "llama3-8b-16gpus"]) == 0
    assert (tmp_path / "report.html").is_file()


def test_report_command_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    def fails(argv, message):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err

    fails(["report", str(tmp_path / "missing")], "no such folder")
    fails(["report", str(tmp_path)], "no study here")
    assert not (tmp_path / "study.db").exists()  # a report never creates a study
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    optuna.create_study(study_name="not-ours", storage=storage)
    fails(["report", str(tmp_path)], "study 'not-ours' was not created by autotune run")
    fails(["report", str(tmp_path), "--study-name", "nope"], "no study 'nope'")
    optuna.create_study(study_name="second", storage=storage)
    fails(["report", str(tmp_path)], "--study-name: needed to pick one study (it holds not-ours, second)")


def test_report_of_a_study_with_no_complete_trial(tmp_path):
    q = question("tiny", 4, "quick", "cpu")
    q["memory_budget_gb"] = None
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", direction="maximize")
    study.set_user_attr("question", q)
    L = Layout(dp=4, dp_shard=4)
    study.add_trial(create_trial(state=TrialState.FAIL, user_attrs={
        "layout": str(L), "layout_short": L.short(), "status": "failed", "reason": "crash",
        "error": "rank 2 died with signal SIGSEGV"}))
    write_reports(study, tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert "No layout completed (1 failed/crash)" in page
    assert "Parameter importance needs at least 3 complete trials; this study has 0." in page
    assert "rank 2 died with signal SIGSEGV" in page
    assert not (tmp_path / "best").exists()
    assert len(pd.read_csv(tmp_path / "trials.csv")) == 1
