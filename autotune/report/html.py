"""report.html: one self-contained page, the question first, then the answer.

Works offline and in any browser: plotly.js is embedded (no CDN: clusters often
have no internet), the ranking table sorts with a few lines of plain JavaScript,
and the CSS is inline. Every string that comes from the user or a trial (model
name, space description, error text, stderr) goes through `html.escape`; charts
carry only parsed layout labels (charts.py).
"""

from __future__ import annotations

import datetime as dt
import html
import json

import optuna
import pandas as pd
from plotly.offline import get_plotlyjs

from autotune.config import model_from_dict
from autotune.errors import UsageError
from autotune.export.ours import trial_command
from autotune.record import COMPLETE, Question
from autotune.report import charts
from autotune.report.answer import OBJECTIVE_LABEL, Answer, answer, outcome, present

e = html.escape
PLOT_CONFIG = {"displaylogo": False, "responsive": True}
BADGE = {"confirms": ("✓", "good"), "breaks": ("!", "warn"), "note": ("i", "info")}


def render_report(study: optuna.Study, question: Question, table: pd.DataFrame) -> str:
    result = answer(question, table)
    threshold = question.max_comm_fraction
    figures = [charts.throughput_by_layout(table), charts.memory_vs_throughput(table, question.memory_budget_gb),
               charts.exposed_comm(table, threshold), charts.predicted_vs_measured(table),
               charts.history(table, result.objective), charts.param_importance(study)]
    title = f"autotune: {question.model_name} on {question.gpus} GPUs"
    body = "\n".join([
        f"<header><h1>{e(title)}</h1><p class='sub'>study {e(study.study_name)} · report written "
        f"{dt.datetime.now().strftime('%Y-%m-%d %H:%M')}</p></header>",
        section("question", "The question", question_html(question, table, study.user_attrs.get("stopped"))),
        section("answer", "The answer", answer_html(question, result)),
        section("ranking", "Ranking of the measured layouts", ranking_html(result)),
        section("charts", "Charts", "\n".join(chart_html(chart) for chart in figures)),
        section("pruned", "Pruned and failed trials", pruned_html(table)),
        section("definitions", "How to read this", DEFINITIONS),
    ])
    return PAGE.format(title=e(title), css=CSS, plotly=get_plotlyjs(), body=body, script=SORT_SCRIPT)


def section(anchor: str, title: str, inner: str) -> str:
    return f"<section id='{anchor}'><h2>{e(title)}</h2>\n{inner}\n</section>"


def fmt(value, pattern: str = "{:,.4g}", missing: str = "–") -> str:
    return pattern.format(value) if present(value) else missing


def definition_list(items: list[tuple[str, str]]) -> str:
    """Pairs of already-escaped HTML."""
    return "<dl>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"


# -- the question ---------------------------------------------------------------------------
def question_html(q: Question, table: pd.DataFrame, stopped: str | None = None) -> str:
    m, hw, space = q.model, q.hardware, q.space
    try:
        config = model_from_dict(m)
        size = f"{config.num_params() / 1e9:.3g} B" if config.num_params() >= 1e8 else f"{config.num_params():,}"
    except (UsageError, TypeError, KeyError):
        size = "–"
    moe = m.get("moe")
    model_items = [
        ("name", e(str(m.get("name", "?")))), ("parameters", size),
        ("layers · hidden · ffn", e(f"{m.get('num_layers')} · {m.get('hidden_size')} · {m.get('ffn_hidden_size')}")),
        ("heads / kv heads", e(f"{m.get('num_heads')} / {m.get('num_kv_heads')}")),
        ("sequence · global batch", e(f"{m.get('seq_len')} tokens · {m.get('global_batch_size')} sequences")),
        ("dtype", e(str(m.get("dtype")))),
    ]
    if moe:
        model_items.append(("MoE", e(f"{moe.get('num_experts')} experts, top-{moe.get('top_k')}")))
    hw_items = [
        ("GPUs", e(f"{q.gpus} ({q.device}), {q.per_node} per node, {q.scale_up} per scale-up domain")),
        ("hardware", e(str(hw.get("name", "?")))),
        ("peak", e(f"{hw.get('peak_tflops')} TFLOP/s per device" if hw.get("peak_tflops") else
                   "measured on the CPU")),
        ("memory", e(f"{hw.get('memory_gb')} GB per device" if hw.get("memory_gb") else "no device limit")),
        ("links", e(f"{q.hardware_config.scale_up_gbps} GB/s in the scale-up domain, "
                    f"{q.hardware_config.scale_out_gbps} GB/s across")),
    ]
    values = space.get("values") or {}
    search_items = [
        ("space", e(str(space.get("name", "?"))) + (f" — {e(space['description'])}" if space.get("description")
                                                      else "")),
        ("sampler · objective", e(f"{q.sampler} · {OBJECTIVE_LABEL.get(q.objective, q.objective)}")),
        ("keys searched", "<br>".join(f"<code>{e(k)}</code>: {e(', '.join(map(str, v)))}" for k, v in values.items())
         or "–"),
    ]
    durations = table["duration_s"].dropna()
    budget = q.memory_budget_gb
    budget_items = [
        ("trials", e(f"{q.trials} launches at most" if q.trials else "every layout (--exhaustive)" if q.exhaustive
                     else "until more trials are not expected to pay (the stopping rule)")),
        ("stopped", e(stopped or "–")),
        ("time", e(f"{q.time_budget_s:,.0f} s" if q.time_budget_s else "no limit")),
        ("memory budget", e(f"{budget:g} GiB per GPU" if budget else "none")),
        ("max exposed comm", e(f"{q.max_comm_fraction:.0%} of the step")),
        ("each trial", e(f"{q.warmup} warm-up + {q.steps} measured steps, seed {q.seed}")),
        ("spent", e(f"{len(table)} trials, {durations.sum() / 60:,.1f} min of trial time")),
    ]
    cards = [("Model", model_items), ("GPUs and hardware", hw_items), ("Search", search_items),
             ("Budget", budget_items)]
    return "<div class='grid2'>" + "".join(
        f"<div class='card'><h3>{t}</h3>{definition_list(items)}</div>" for t, items in cards) + "</div>"


# -- the answer -----------------------------------------------------------------------------
def answer_html(q: Question, result: Answer) -> str:
    best = result.best
    if best is None:
        return f"<p class='verdict bad'>{e(result.summary)}</p>"
    budget = q.memory_budget_gb
    peak = fmt(best["peak_mem_gb"], "{:.2f} GiB") + (f" of {budget:g}" if budget and present(best["peak_mem_gb"])
                                                      else "")
    kpis = [("tokens/s", fmt(best["tokens_per_s"], "{:,.0f}")),
            ("tokens/s per GPU", fmt(best["tokens_per_s_per_gpu"], "{:,.0f}")),
            ("MFU", fmt(best["mfu"], "{:.1%}")), ("step time", fmt(best["step_time_s"], "{:.3g} s")),
            ("peak memory", peak), ("exposed comm", fmt(best["exposed_comm_fraction"], "{:.0%}")),
            ("grad accumulation", fmt(best["grad_accum"], "{:.0f}"))]
    command = trial_command(q, best["layout"], "best/model.yaml")
    parts = [
        f"<div class='recommend'><div class='label'>Train with</div>"
        f"<div class='layout'>{e(best['layout_short'])}</div>"
        f"<div class='full'>trial {int(best['trial'])} · <code>{e(best['layout'])}</code><br>{e(gpu_split(best))}</div>"
        f"<div class='kpis'>" + "".join(f"<div class='kpi'><div class='v'>{e(v)}</div><div class='k'>{e(k)}</div>"
                                      f"</div>" for k, v in kpis) + "</div></div>",
        f"<p class='verdict'>{e(result.summary)}</p>",
    ]
    if result.rules:
        items = "".join(
            f"<li class='{BADGE[r.verdict][1]}'><span class='badge'>{BADGE[r.verdict][0]}</span><div>"
            f"<b>{e(r.title)}</b>" + (f" <span class='tag'>{e(r.verdict)} the rule of thumb</span>"
                                     if r.verdict != "note" else "") + f"<br>{e(r.text)}</div></li>"
            for r in result.rules)
        parts.append(f"<h3>Why it won</h3><ul class='rules'>{items}</ul>")
    parts.append(f"<h3>What the runner-up costs</h3><p>{e(result.runner_up_text)}</p>")
    if result.choices:
        parts.append("<h3>What each choice is worth</h3><p class='hint'>For every layout key the study varied. "
                     "Hover a value for how its trials ended.</p>" + choices_html(result))
    parts.append(
        "<h3>Use it</h3><p>Measure it again with our runtime, from this report's folder:</p>"
        f"<pre>{e(command)}</pre><p><code>best/</code> holds the same layout for other frameworks: "
        "<a href='best/README.md'>README.md</a> · <a href='best/torchrun.sh'>torchrun.sh</a> · "
        "<a href='best/torchtitan.sh'>torchtitan.sh</a> · <a href='best/megatron_args.sh'>megatron_args.sh</a>"
        " · <a href='best/deepspeed.json'>deepspeed.json</a> (these two where the framework can run the layout: "
        "best/README.md says why one is missing); each says which settings map exactly and which have no "
        "equivalent there.</p>")
    return "\n".join(parts)


def gpu_split(best) -> str:
    """How the GPUs are cut: our mesh's reading, and for MoE the seeds' reading with expert data parallel."""
    tp, pp, cp, ep, dp = (int(best[k]) for k in ("tp", "pp", "cp", "ep", "dp"))
    text = f"GPUs = PP × DP × CP × TP = {pp} × {dp} × {cp} × {tp} = {pp * dp * cp * tp}"
    if ep > 1 and dp % ep == 0:
        text += (f"; for the experts, TP × PP × CP × EP × DP_expert = {tp} × {pp} × {cp} × {ep} × {dp // ep}"
                 f" (DP_expert = DP / EP)")
    elif ep > 1:
        text += f"; EP = {ep} is carved from dp_shard × cp = {int(best['dp_shard'])} × {cp}"
    return text


def choices_html(result: Answer) -> str:
    """One row per layout key: the recommended value, then every other value tried with the
    best measured layout that has it (relative to the recommended one), or how its trials ended."""
    rows = []
    for key in dict.fromkeys(c.key for c in result.choices):
        group = [c for c in result.choices if c.key == key]
        chosen = next(c for c in group if c.chosen)
        alternatives = []
        for c in group:
            if c.chosen:
                continue
            if c.best_trial is None:
                alternatives.append(f"<span class='alt' title='{e(c.outcomes)}'><code>{e(str(c.value))}</code> "
                                    f"<span class='none'>none completed ({e(c.outcomes)})</span></span>")
            else:
                sign = "neg" if c.vs_best < 0 else "pos"
                alternatives.append(f"<span class='alt' title='{e(c.outcomes)}'><code>{e(str(c.value))}</code> "
                                    f"<span class='d {sign}'>{c.vs_best:+.0%}</span> (#{c.best_trial})</span>")
        rows.append(f"<tr><td><b>{e(key)}</b></td><td><code>{e(str(chosen.value))}</code></td>"
                    f"<td class='n'>{chosen.trials}</td><td>{''.join(alternatives)}</td></tr>")
    return ("<table class='choices'><thead><tr><th>key</th><th>recommended</th><th>trials with it</th>"
            "<th>other values: best measured layout with that value vs the recommended (trial)</th></tr></thead>"
            "<tbody>" + "".join(rows) + "</tbody></table>")


# -- tables ---------------------------------------------------------------------------------
RANKING_COLUMNS = [  # (key, header, format)
    ("rank", "#", "{:.0f}"), ("trial", "trial", "{:.0f}"), ("layout_short", "layout", None),
    ("tokens_per_s", "tokens/s", "{:,.0f}"), ("tokens_per_s_per_gpu", "per GPU", "{:,.0f}"),
    ("mfu", "MFU", "{:.1%}"), ("step_time_s", "step s", "{:.3g}"), ("peak_mem_gb", "peak GiB", "{:.2f}"),
    ("exposed_comm_fraction", "exposed", "{:.0%}"), ("comm_fraction", "comm", "{:.0%}"),
    ("grad_accum", "accum", "{:.0f}"), ("predicted_tokens_per_s", "predicted", "{:,.0f}"),
]
RANKING_TITLES = {"tokens_per_s_per_gpu": "tokens/s per GPU", "exposed_comm_fraction": "exposed communication share",
                  "comm_fraction": "communication share, overlapped or not", "grad_accum": "gradient accumulation "
                  "(micro-batches per step)", "predicted_tokens_per_s": "the estimator's tokens/s"}


def ranking_html(result: Answer) -> str:
    ranked = result.ranked
    if ranked.empty:
        return "<p class='empty'>No layout completed yet.</p>"
    head = "".join(f"<th data-key='{key}'{'' if pattern is None else ' class=n'} title='"
                   f"{e(RANKING_TITLES.get(key, header))}: click to sort'>{e(header)}</th>"
                   for key, header, pattern in RANKING_COLUMNS)
    rows = []
    for rank, (_, row) in enumerate(ranked.iterrows(), start=1):
        cells = []
        for key, _, pattern in RANKING_COLUMNS:
            value = rank if key == "rank" else row[key]
            if pattern is None:
                cells.append(f"<td class='layout' data-sort='{e(str(value))}'><code>{e(str(value))}</code></td>")
            else:
                sort = json.dumps(float(value)) if present(value) else ""
                cells.append(f"<td class='n' data-sort='{sort}'>{e(fmt(value, pattern))}</td>")
        rows.append(f"<tr{' class=chosen' if rank == 1 else ''}>{''.join(cells)}</tr>")
    return ("<p class='hint'>Complete trials, best first. Click a column header to sort; click again to reverse."
            "</p><div class='scroll'><table id='ranking' class='sortable'><thead><tr>" + head + "</tr></thead><tbody>"
            + "".join(rows) + "</tbody></table></div>")


def pruned_html(table: pd.DataFrame) -> str:
    others = table[table["status"] != COMPLETE].sort_values("trial")
    if others.empty:
        return "<p class='empty'>None: every trial completed.</p>"
    rows = []
    for _, row in others.iterrows():
        name = outcome(row)
        detail = e(str(row["error"])) if present(row["error"]) else "–"
        if present(row["stderr_tail"]):
            detail += f"<details><summary>stderr</summary><pre>{e(str(row['stderr_tail']))}</pre></details>"
        rows.append(
            f"<tr><td class='n'>{int(row['trial'])}</td><td><code>{e(str(row['layout_short'] or '–'))}</code></td>"
            f"<td><span class='pill' style='background:{charts.color(name)}'>{e(name)}</span></td>"
            f"<td class='detail'>{detail}</td><td class='n'>{e(fmt(row['predicted_peak_mem_gb'], '{:.2f}'))}</td>"
            f"<td class='n'>{e(fmt(row['peak_mem_gb'], '{:.2f}'))}</td>"
            f"<td class='n'>{e(fmt(row['exposed_comm_fraction'], '{:.0%}'))}</td>"
            f"<td class='n'>{e(fmt(row['duration_s'], '{:.0f}'))}</td></tr>")
    counts = others.groupby(others.apply(outcome, axis=1)).size()
    told = " · ".join(f"{n} {name}" for name, n in counts.items())
    return (f"<p class='hint'>{e(told)}. Measured figures are kept where the trial ran.</p><div class='scroll'>"
            "<table id='pruned'><thead><tr><th>trial</th><th>layout</th><th>outcome</th><th>why</th>"
            "<th>predicted GiB</th><th>peak GiB</th><th>exposed comm</th><th>trial s</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table></div>")


def chart_html(chart: charts.Chart) -> str:
    title = f"<h3>{e(chart.title)}</h3>"
    if chart.figure is None:
        return f"<div class='chart-note' id='chart-{chart.name}'>{title}<p class='empty'>{e(chart.note)}</p></div>"
    inner = chart.figure.to_html(full_html=False, include_plotlyjs=False, div_id=f"chart-{chart.name}-plot",
                                 config=PLOT_CONFIG, default_height=f"{chart.figure.layout.height}px")
    return f"<div class='chart' id='chart-{chart.name}'>{title}{inner}</div>"


DEFINITIONS = """<dl class='defs'>
<dt>tokens/s</dt><dd>global batch × sequence length / step time, over every GPU; per GPU: divided by the world
size.</dd>
<dt>step time</dt><dd>median wall time of the measured optimizer steps.</dd>
<dt>MFU</dt><dd>model FLOPs per token × tokens/s / (GPUs × peak FLOP/s); recompute is not counted as useful work.</dd>
<dt>peak memory</dt><dd>the largest peak over the ranks during the measured steps.</dd>
<dt>all / exposed comm</dt><dd>share of the step in which a rank communicates / communicates while not computing
(the part that costs time); the larger value over the ranks.</dd>
<dt>outcomes</dt><dd>complete: measured · pruned/predicted_oom: the estimator said it cannot fit, never launched ·
pruned/oom: ran out of memory or over the budget · pruned/comm_bound: exposed communication over the threshold
(figures kept) · failed/timeout, crash, error: the run did not finish; its reason and last output are kept.</dd>
</dl>"""

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{css}</style>
<script>{plotly}</script>
</head><body><main>
{body}
</main><script>{script}</script></body></html>
"""

CSS = """
:root { --fg:#1f2933; --muted:#616e7c; --line:#e4e7eb; --bg:#f5f7fa; --accent:#1c7ed6; --good:#2b8a3e;
        --warn:#d9480f; --info:#5c7cfa; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--fg);
       font:14px/1.5 system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif; }
main { max-width:1240px; margin:0 auto; padding:24px 28px 60px; }
header h1 { margin:0; font-size:26px; } .sub { color:var(--muted); margin:2px 0 18px; }
section { background:#fff; border:1px solid var(--line); border-radius:10px; padding:18px 22px; margin:18px 0; }
h2 { margin:0 0 12px; font-size:19px; } h3 { margin:18px 0 8px; font-size:15px; }
.card h3 { margin-top:0; }
.grid2 { display:grid; grid-template-columns:repeat(auto-fit, minmax(440px, 1fr)); gap:14px; }
.card { border:1px solid var(--line); border-radius:8px; padding:12px 14px; background:#fbfcfd; }
dl { margin:0; display:grid; grid-template-columns:minmax(120px, max-content) 1fr; gap:3px 14px; }
dt { color:var(--muted); white-space:nowrap; } dd { margin:0; overflow-wrap:anywhere; }
dl.defs { grid-template-columns:140px 1fr; }
code, pre { font-family:ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size:12.5px; }
pre { background:#f1f3f5; padding:10px 12px; border-radius:6px; overflow-x:auto; white-space:pre-wrap;
      overflow-wrap:anywhere; }
.recommend { border:2px solid var(--good); border-radius:10px; padding:14px 18px; background:#f4fbf6; }
.recommend .label { color:var(--good); font-weight:600; text-transform:uppercase; font-size:12px;
                    letter-spacing:.05em; }
.recommend .layout { font-size:24px; font-weight:700; font-family:ui-monospace, Menlo, Consolas, monospace; }
.recommend .full { color:var(--muted); margin-bottom:10px; overflow-wrap:anywhere; }
.kpis { display:flex; flex-wrap:wrap; gap:10px; }
.kpi { background:#fff; border:1px solid var(--line); border-radius:8px; padding:8px 14px; min-width:120px; }
.kpi .v { font-size:18px; font-weight:650; } .kpi .k { color:var(--muted); font-size:12px; }
.verdict { font-size:15px; margin:14px 0 4px; } .verdict.bad { color:var(--warn); font-weight:600; }
.hint, .empty { color:var(--muted); } .empty { font-style:italic; }
ul.rules { list-style:none; padding:0; margin:0; display:grid; gap:8px; }
ul.rules li { display:flex; gap:10px; align-items:flex-start; border:1px solid var(--line); border-radius:8px;
              padding:8px 12px; }
.badge { flex:0 0 22px; height:22px; border-radius:50%; color:#fff; text-align:center; font-weight:700;
         line-height:22px; font-size:13px; }
li.good .badge { background:var(--good); } li.warn .badge { background:var(--warn); }
li.info .badge { background:var(--info); }
.tag { font-size:11px; color:var(--muted); border:1px solid var(--line); border-radius:10px; padding:0 7px;
       margin-left:4px; }
.scroll { overflow-x:auto; }
table { border-collapse:collapse; width:100%; font-size:13px; }
th, td { padding:5px 7px; border-bottom:1px solid var(--line); text-align:left; vertical-align:top; }
th { background:#f8f9fa; position:sticky; top:0; white-space:nowrap; font-weight:600; }
td.n, th.n { text-align:right; font-variant-numeric:tabular-nums; white-space:nowrap; }
table.sortable th { cursor:pointer; user-select:none; }
table.sortable th:hover { background:#e7f5ff; }
th[aria-sort=ascending]::after { content:' ▲'; color:var(--accent); }
th[aria-sort=descending]::after { content:' ▼'; color:var(--accent); }
tr.chosen td { background:#f4fbf6; font-weight:600; }
table.choices tr.first td { border-top:2px solid var(--line); }
td.detail { max-width:520px; overflow-wrap:anywhere; }
td.layout { white-space:nowrap; }
.alt { display:inline-block; margin:1px 6px 1px 0; padding:0 8px; white-space:nowrap;
       border-right:1px solid var(--line); }
.alt .d { font-weight:600; } .alt .d.neg { color:var(--warn); } .alt .d.pos { color:var(--good); }
.alt .none { color:var(--muted); font-style:italic; }
details summary { cursor:pointer; color:var(--accent); }
details pre { max-height:260px; overflow:auto; margin:6px 0 0; }
.pill { color:#fff; border-radius:10px; padding:1px 8px; font-size:12px; white-space:nowrap;
        text-shadow:0 0 2px rgba(0,0,0,.35); }
.chart { border:1px solid var(--line); border-radius:8px; padding:10px 10px 4px; margin:14px 0; }
.chart h3, .chart-note h3 { margin:0 4px 4px; font-size:14px; }
.chart-note { border:1px dashed var(--line); border-radius:8px; padding:10px 14px; margin:14px 0; }
.chart-note p { margin:4px; }
a { color:var(--accent); }
"""

SORT_SCRIPT = """
// Sortable tables: a click on a header sorts by that column (numbers by data-sort), a second click
// reverses; rows without a value go last either way.
document.querySelectorAll('table.sortable').forEach(function (table) {
  var headers = table.tHead.rows[0].cells;
  Array.prototype.forEach.call(headers, function (th, col) {
    th.addEventListener('click', function () {
      var ascending = th.getAttribute('aria-sort') !== 'ascending';
      Array.prototype.forEach.call(headers, function (h) { h.removeAttribute('aria-sort'); });
      th.setAttribute('aria-sort', ascending ? 'ascending' : 'descending');
      var body = table.tBodies[0];
      var rows = Array.prototype.slice.call(body.rows);
      function key(row) {
        var text = row.cells[col].getAttribute('data-sort');
        if (text === null || text === '') return null;
        var number = Number(text);
        return isNaN(number) ? text.toLowerCase() : number;
      }
      rows.sort(function (a, b) {
        var x = key(a), y = key(b);
        if (x === null || y === null) return (x === null) - (y === null);
        var order = x < y ? -1 : x > y ? 1 : 0;
        return ascending ? order : -order;
      });
      rows.forEach(function (row) { body.appendChild(row); });
    });
  });
});
"""
