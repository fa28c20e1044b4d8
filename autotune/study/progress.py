"""Live progress of a sweep on stderr: counts, best so far, time and trials left.

In a terminal, one panel redrawn in place (rich Live); in a log file, one line per
event, so an overnight log reads top to bottom.

The estimate of time left: layouts left x the share of outcomes so far that were
launched (a layout pruned before launch costs nothing) x the mean wall time of a
launched trial, capped by what is left of --trials and --time-budget. It is an upper
bound when the stopping rule may end the sweep sooner.
"""

from __future__ import annotations

import statistics
import time

import pandas as pd
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from autotune.record import COMPLETE


def duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Progress:
    def __init__(self, title: str, objective: str, total_layouts: int, trials: int | None,
                 time_budget_s: float | None, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.title = title
        self.objective = objective
        self.total_layouts = total_layouts
        self.trials = trials
        self.time_budget_s = time_budget_s
        self.started = time.monotonic()
        self.running: str | None = None
        self.tally = None
        self.trial_started_at: float | None = None
        self.trial_durations: list[float] = []  # wall time of each launched trial
        self.live = Live(self.render(), console=self.console, refresh_per_second=2,
                         transient=False) if self.console.is_terminal else None

    def __enter__(self):
        if self.live:
            self.live.__enter__()
        else:
            self.console.print(self.title)
        return self

    def __exit__(self, *exc):
        if self.live:
            self.live.update(self.render())
            self.live.__exit__(*exc)

    def trial_started(self, number: int, layout_short: str) -> None:
        self.running = f"#{number}: {layout_short}"
        self.trial_started_at = time.monotonic()
        if self.live:
            self.live.update(self.render())
        else:
            self.console.print(f"[{duration(time.monotonic() - self.started)}] trial {self.running}")

    def trial_finished(self, tally) -> None:
        self.tally = tally
        if self.trial_started_at is not None:  # launched (a layout pruned before launch never starts)
            self.trial_durations.append(time.monotonic() - self.trial_started_at)
            self.trial_started_at = None
        self.running = None
        if self.live:
            self.live.update(self.render())
            return
        last = tally.last or {}
        outcome = last.get("status", "?") + (f"/{last['reason']}" if last.get("reason") else "")
        figure = f" {last[self.objective]:,.4g} {self.objective}" if last.get(self.objective) else ""
        self.console.print(f"[{duration(time.monotonic() - self.started)}]   -> {outcome}{figure}"
                           + (f"  ({last['error']})" if last.get("error") else "") + f"  [{self.remaining()}]",
                           highlight=False)

    def remaining(self) -> str:
        """'N done, M left, ETA at most T' (module docstring), or the counts alone before a
        launched trial has finished."""
        t = self.tally
        done = t.complete + t.pruned + t.failed if t else 0
        left = max(0, self.total_layouts - done)
        if self.trials is not None and t is not None:
            left = min(left, max(0, self.trials - t.launched))
        text = f"{done} done, {left} left"
        if not self.trial_durations or not done or t is None:
            return text
        seconds = left * min(1.0, t.launched / done) * statistics.mean(self.trial_durations)
        if self.time_budget_s:
            seconds = min(seconds, max(0.0, self.time_budget_s - (time.monotonic() - self.started)))
        return f"{text}, ETA at most {duration(seconds)}"

    def render(self) -> Panel:
        t = self.tally
        lines = [Text(self.title, style="bold")]
        if t is not None:
            lines.append(Text(f"trials: {t.complete} complete · {t.pruned} pruned · {t.failed} failed "
                              f"· {t.launched} launched of {self.trials or 'all'}"))
            lines.append(Text(self.remaining(), style="dim"))
            if t.best:
                lines.append(Text(f"best: {t.best['value']:,.4g} {self.objective}  {t.best.get('layout_short', '')}",
                                  style="green"))
        if self.running:
            lines.append(Text(f"running {self.running}", style="cyan"))
        elapsed = time.monotonic() - self.started
        left = f" · {duration(max(0.0, self.time_budget_s - elapsed))} left" if self.time_budget_s else ""
        lines.append(Text(f"elapsed {duration(elapsed)}{left}", style="dim"))
        return Panel(Group(*lines), title="autotune", expand=False)


def summary_table(frame: pd.DataFrame, objective: str, top: int = 10) -> Table:
    """The best complete layouts, then a count of the rest by outcome."""
    done = frame[frame["status"] == COMPLETE].sort_values(objective, ascending=False).head(top)
    table = Table(title=f"top layouts by {objective}")
    for col in ("trial", "layout", "tokens/s", "MFU", "peak GiB", "exposed comm"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for _, r in done.iterrows():
        layout = " ".join(f"{k}={r[k]}" for k in ("tp", "pp", "cp", "ep", "dp") if r[k] and int(r[k]) > 1)
        layout += f" zero={r['zero']} mbs={r['mbs']}" + (f" {r['schedule']}" if r["pp"] > 1 else "") + \
            (" sp" if r["sp"] else "") + (f" rc={r['recompute']}" if r["recompute"] != "none" else "")
        table.add_row(str(r["trial"]), layout.strip(), f"{r['tokens_per_s']:,.0f}", _fmt(r["mfu"], "{:.1%}"),
                      _fmt(r["peak_mem_gb"], "{:.2f}"), _fmt(r["exposed_comm_fraction"], "{:.0%}"))
    counts = frame.groupby(["status", "reason"], dropna=False).size()
    table.caption = " · ".join(f"{n} {s}" + (f"/{r}" if isinstance(r, str) else "") for (s, r), n in counts.items())
    return table


def _fmt(value, pattern: str) -> str:
    return "-" if value is None or pd.isna(value) else pattern.format(value)
