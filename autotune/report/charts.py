"""The report's charts: plotly figures built from the trial table.

Each function returns a Chart: its title (set in HTML above the plot, so plotly's
top margin is free for the legend) and a figure, or a note saying why there is
none (no trial measured yet, too few complete trials for parameter importance).
Layout labels are `#trial layout_short`, strings the layout parser has already
checked; no free text from the user or a trial goes into a chart.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import optuna
import pandas as pd
import plotly.graph_objects as go
from optuna.trial import TrialState
from plotly.subplots import make_subplots

from autotune.record import COMPLETE
from autotune.report.answer import OBJECTIVE_LABEL, outcome

OUTCOME_COLORS = {
    "complete": "#2a9d8f",
    "pruned/comm_bound": "#e9c46a",
    "pruned/oom": "#e76f51",
    "pruned/predicted_oom": "#f4a261",
    "pruned/invalid": "#adb5bd",
    "failed/timeout": "#6d597a",
    "failed/crash": "#9b2226",
    "failed/error": "#bc4749",
    "failed/interrupted": "#adb5bd",
}
MAX_BARS = 40  # beyond this a bar chart shows the fastest layouts only
FONT = dict(family="system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif", size=12, color="#1f2933")


@dataclass
class Chart:
    name: str
    title: str
    figure: go.Figure | None = None
    note: str = ""  # why there is no figure


def color(name: str) -> str:
    return OUTCOME_COLORS.get(name, "#868e96")


def labelled(table: pd.DataFrame) -> pd.DataFrame:
    frame = table.copy()
    frame["label"] = "#" + frame["trial"].astype(str) + "  " + frame["layout_short"].fillna("?")
    frame["outcome"] = frame.apply(outcome, axis=1)
    return frame


def style(fig: go.Figure, height: int) -> go.Figure:
    # The mode bar stands upright in the right margin, so it never covers the legend above the plot.
    fig.update_layout(template="plotly_white", height=height, font=FONT, margin=dict(l=10, r=44, t=36, b=50),
                      legend=dict(orientation="h", yanchor="bottom", y=1.01, xanchor="left", x=0),
                      modebar=dict(orientation="v"),
                      hoverlabel=dict(font=dict(family=FONT["family"])))
    return fig


def measured(table: pd.DataFrame) -> pd.DataFrame:
    """Trials with a measured throughput, fastest first (at most MAX_BARS)."""
    frame = labelled(table)
    frame = frame[frame["tokens_per_s"].notna()].sort_values(["tokens_per_s", "trial"], ascending=[False, True])
    return frame.head(MAX_BARS)


def bar_height(n: int) -> int:
    return max(260, 110 + 24 * n)


def throughput_by_layout(table: pd.DataFrame) -> Chart:
    frame = measured(table)
    total = int(table["tokens_per_s"].notna().sum())
    shown = f" (fastest {len(frame)} of {total})" if total > len(frame) else ""
    chart = Chart("throughput", f"Tokens/s per layout, coloured by outcome{shown}")
    if frame.empty:
        chart.note = "No trial has a measured throughput yet."
        return chart
    fig = go.Figure()
    for name, group in frame.groupby("outcome", sort=False):
        fig.add_bar(y=group["label"], x=group["tokens_per_s"], orientation="h", name=name,
                    marker_color=color(name), customdata=group[["mfu", "peak_mem_gb"]].astype(float).values,
                    hovertemplate="%{y}<br>%{x:,.0f} tokens/s<br>MFU %{customdata[0]:.1%}"
                                  "<br>peak %{customdata[1]:.2f} GiB<extra>" + name + "</extra>")
    fig.update_yaxes(categoryorder="array", categoryarray=list(frame["label"])[::-1], automargin=True)
    fig.update_xaxes(title="tokens/s (measured)", rangemode="tozero")
    chart.figure = style(fig, bar_height(len(frame)))
    return chart


def memory_vs_throughput(table: pd.DataFrame, budget_gb: float | None) -> Chart:
    """Measured trials at their measured peak; layouts pruned unlaunched at their predicted one."""
    chart = Chart("memory", "Peak memory vs tokens/s" + (f", with the memory budget of {budget_gb:g} GiB" if budget_gb
                                                          else " (no memory budget on this device)"))
    frame = labelled(table)
    ran = frame[frame["peak_mem_gb"].notna() & frame["tokens_per_s"].notna()]
    guessed = frame[(frame["reason"] == "predicted_oom") & frame["predicted_peak_mem_gb"].notna()
                    & frame["predicted_tokens_per_s"].notna()]
    if ran.empty and guessed.empty:
        chart.note = "No trial has a measured or predicted peak memory yet."
        return chart
    fig = go.Figure()
    for name, group in ran.groupby("outcome", sort=False):
        fig.add_scatter(x=group["peak_mem_gb"], y=group["tokens_per_s"], mode="markers", name=name,
                        text=group["label"], marker=dict(color=color(name), size=10, line=dict(width=1, color="#fff")),
                        hovertemplate="%{text}<br>peak %{x:.2f} GiB<br>%{y:,.0f} tokens/s<extra>" + name + "</extra>")
    if not guessed.empty:
        name = "pruned/predicted_oom"
        fig.add_scatter(x=guessed["predicted_peak_mem_gb"], y=guessed["predicted_tokens_per_s"], mode="markers",
                        name=f"{name} (predicted figures, not run)", text=guessed["label"],
                        marker=dict(color=color(name), size=10, symbol="circle-open", line=dict(width=2)),
                        hovertemplate="%{text}<br>predicted peak %{x:.2f} GiB<br>predicted %{y:,.0f} tokens/s"
                                      "<extra>" + name + "</extra>")
    if budget_gb:
        fig.add_vline(x=budget_gb, line=dict(color="#c92a2a", dash="dash", width=2),
                      annotation_text=f"memory budget {budget_gb:g} GiB", annotation_position="bottom left",
                      annotation_font_color="#c92a2a")
    fig.update_xaxes(title="peak memory per GPU (GiB)", rangemode="tozero")
    fig.update_yaxes(title="tokens/s", rangemode="tozero")
    chart.figure = style(fig, 440)
    return chart


def exposed_comm(table: pd.DataFrame, threshold: float) -> Chart:
    chart = Chart("comm", f"Communication share of the step, with the {threshold:.0%} threshold on the exposed part")
    frame = measured(table)
    frame = frame[frame["exposed_comm_fraction"].notna()]
    if frame.empty:
        chart.note = "No trial has a measured communication fraction yet."
        return chart
    fig = go.Figure()
    if frame["comm_fraction"].notna().any():
        fig.add_bar(y=frame["label"], x=frame["comm_fraction"], orientation="h", name="all communication",
                    marker_color="#d0ebff", hovertemplate="%{y}<br>communicating %{x:.0%} of the step<extra></extra>")
    fig.add_bar(y=frame["label"], x=frame["exposed_comm_fraction"], orientation="h",
                name="exposed, not overlapped (coloured by outcome)",
                marker_color=[color(name) for name in frame["outcome"]],
                hovertemplate="%{y}<br>exposed %{x:.0%} of the step<extra></extra>")
    fig.add_vline(x=threshold, line=dict(color="#c92a2a", dash="dash", width=2),
                  annotation_text=f"threshold {threshold:.0%}", annotation_position="bottom right",
                  annotation_font_color="#c92a2a")
    fig.update_layout(barmode="overlay")
    fig.update_yaxes(categoryorder="array", categoryarray=list(frame["label"])[::-1], automargin=True)
    fig.update_xaxes(title="share of the step", tickformat=".0%", range=[0, max(1.0, threshold * 1.1)])
    chart.figure = style(fig, bar_height(len(frame)))
    return chart


def predicted_vs_measured(table: pd.DataFrame) -> Chart:
    chart = Chart("predicted", "Predicted vs measured: peak memory and throughput (on the dotted line the "
                               "estimator was exact)")
    frame = labelled(table)
    pairs = (("predicted_peak_mem_gb", "peak_mem_gb", "peak memory (GiB)"),
             ("predicted_tokens_per_s", "tokens_per_s", "tokens/s"))
    if not any((frame[p].notna() & frame[m].notna()).any() for p, m, _ in pairs):
        chart.note = "No trial has both a prediction and a measurement yet."
        return chart
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1)
    seen = set()
    for col, (pred, meas, what) in enumerate(pairs, start=1):
        both = frame[frame[pred].notna() & frame[meas].notna()]
        if both.empty:
            continue
        top = float(max(both[pred].max(), both[meas].max())) * 1.05
        fig.add_scatter(x=[0, top], y=[0, top], mode="lines", line=dict(color="#adb5bd", dash="dot"),
                        name="measured = predicted", showlegend=col == 1, hoverinfo="skip", row=1, col=col)
        for name, group in both.groupby("outcome", sort=False):
            fig.add_scatter(x=group[pred], y=group[meas], mode="markers", name=name, text=group["label"],
                            legendgroup=name, showlegend=name not in seen,
                            marker=dict(color=color(name), size=9, line=dict(width=1, color="#fff")),
                            hovertemplate="%{text}<br>predicted %{x:,.4g}<br>measured %{y:,.4g}<extra></extra>",
                            row=1, col=col)
            seen.add(name)
        fig.update_xaxes(title_text=f"predicted {what}", rangemode="tozero", row=1, col=col)
        fig.update_yaxes(title_text=f"measured {what}", rangemode="tozero", row=1, col=col)
    chart.figure = style(fig, 420)
    return chart


def history(table: pd.DataFrame, objective: str) -> Chart:
    label = OBJECTIVE_LABEL.get(objective, objective)
    chart = Chart("history", f"Optimisation history: {label} of each complete trial, and the best so far")
    frame = labelled(table).sort_values("trial")
    done = frame[frame["status"] == COMPLETE]
    if done.empty:
        chart.note = "No trial completed yet."
        return chart
    fig = go.Figure()
    fig.add_scatter(x=done["trial"], y=done["value"], mode="markers", name="complete trial", text=done["label"],
                    marker=dict(color=color("complete"), size=9),
                    hovertemplate="%{text}<br>%{y:,.4g} " + label + "<extra></extra>")
    fig.add_scatter(x=done["trial"], y=done["value"].cummax(), mode="lines", name="best so far",
                    line=dict(color="#1c7ed6", shape="hv", width=2), hoverinfo="skip")
    others = frame[frame["status"] != COMPLETE]
    if not others.empty:
        fig.add_scatter(x=others["trial"], y=[0] * len(others), mode="markers", name="pruned or failed (at 0)",
                        text=others["label"] + "  " + others["outcome"],
                        marker=dict(color="#adb5bd", symbol="x-thin", size=9, line=dict(width=2, color="#adb5bd")),
                        hovertemplate="%{text}<extra></extra>")
    fig.update_xaxes(title="trial", dtick=max(1, math.ceil(len(frame) / 20)))
    fig.update_yaxes(title=label, rangemode="tozero", tickformat=".0%" if objective == "mfu" else ",")
    chart.figure = style(fig, 380)
    return chart


def param_importance(study: optuna.Study) -> Chart:
    """Optuna's parameter importances (PED-ANOVA, its default) over the layout keys the
    sampler suggested, on the complete trials; it needs a few of them and some variety."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    chart = Chart("importance", f"Which layout keys mattered: Optuna's parameter importance over "
                                f"{len(complete)} complete trials"
                                + (" (fewer than 10: indicative only)" if len(complete) < 10 else ""))
    if len(complete) < 3:
        chart.note = f"Parameter importance needs at least 3 complete trials; this study has {len(complete)}."
        return chart
    keys = set.intersection(*(set(t.params) for t in complete))
    keys = sorted(k for k in keys if len({repr(t.params[k]) for t in complete}) > 1)
    if not keys:
        chart.note = "The complete trials share the value of every layout key the sampler varied."
        return chart
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importances = optuna.importance.get_param_importances(study, params=keys)
    except (ValueError, RuntimeError, ZeroDivisionError) as e:
        chart.note = f"Parameter importance could not be computed on these trials ({e})."
        return chart
    if not importances or not any(v > 0 for v in importances.values()):
        chart.note = "No layout key stands out on these complete trials."
        return chart
    names = list(importances)[::-1]
    fig = go.Figure(go.Bar(y=names, x=[importances[k] for k in names], orientation="h",
                           marker_color="#1c7ed6", hovertemplate="%{y}: %{x:.2f}<extra></extra>"))
    fig.update_xaxes(title="importance (PED-ANOVA, Optuna's default; sums to 1)", rangemode="tozero")
    fig.update_yaxes(automargin=True)
    chart.figure = style(fig, bar_height(len(names)))
    return chart
