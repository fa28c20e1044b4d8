"""report.html in a real browser: headless Chromium loads it offline, draws every chart,
sorts the ranking on a click, and never runs a script hidden in a model name; the same
for the report of a small real sweep.

A full-page screenshot is written to the test's tmp folder and, when the environment
variable AUTOTUNE_SCREENSHOT_DIR names a folder, there too, for people to look at.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas
import pytest

from autotune.report import write_reports
from support.chromium import CHROMIUM, Chromium
from support.report_study import make_study

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason=f"needs Chromium at {CHROMIUM} (Debian: apt-get install chromium; CI installs "
                                       f"it in .ci/run)")
CHARTS = ("throughput", "memory", "comm", "predicted", "history", "importance")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    b = Chromium(tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


def column(page, key: str) -> list:
    """The ranking table's cells of one column, top to bottom, as the sorter reads them."""
    return page.evaluate(f"""(() => {{
        const col = Array.from(document.querySelectorAll('#ranking th')).findIndex(th => th.dataset.key === '{key}');
        return Array.from(document.querySelectorAll('#ranking tbody tr')).map(
            tr => tr.cells[col].getAttribute('data-sort'));
    }})()""")


def click(page, selector: str) -> None:
    """A real mouse click at the element's centre (press and release), as a person clicks."""
    box = page.evaluate(f"""(() => {{
        const el = document.querySelector("{selector}");
        el.scrollIntoView({{block: 'center'}});
        const r = el.getBoundingClientRect();
        return {{x: r.x + r.width / 2, y: r.y + r.height / 2}};
    }})()""")
    for kind in ("mousePressed", "mouseReleased"):
        page.send("Input.dispatchMouseEvent", type=kind, x=box["x"], y=box["y"], button="left", clickCount=1)


def test_report_loads_offline_draws_and_sorts(tmp_path, browser):
    study = make_study(tmp_path)
    write_reports(study, tmp_path)
    page = browser.open((tmp_path / "report.html").as_uri())
    drawn = page.wait_until("document.querySelectorAll('.chart .main-svg').length >= %d" % len(CHARTS))
    assert drawn
    for chart in CHARTS:  # every chart has its own SVG with plotted marks
        assert page.evaluate(f"document.querySelectorAll('#chart-{chart} svg.main-svg').length") >= 1, chart
        assert page.evaluate(f"document.querySelectorAll('#chart-{chart} .trace .point').length") > 0, chart
    measured = sum("tokens_per_s" in t.user_attrs for t in study.trials)
    assert page.evaluate("document.querySelectorAll('#chart-throughput .trace .point').length") == measured
    assert page.errors() == []

    complete = sum(t.state.name == "COMPLETE" for t in study.trials)
    values = column(page, "tokens_per_s")
    assert len(values) == complete
    assert [float(v) for v in values] == sorted((float(v) for v in values), reverse=True)  # best first
    click(page, "#ranking th[data-key=tokens_per_s]")
    assert page.evaluate("document.querySelector('#ranking th[data-key=tokens_per_s]').getAttribute('aria-sort')") \
        == "ascending"
    assert [float(v) for v in column(page, "tokens_per_s")] == sorted(float(v) for v in values)
    click(page, "#ranking th[data-key=tokens_per_s]")
    assert [float(v) for v in column(page, "tokens_per_s")] == sorted((float(v) for v in values), reverse=True)
    click(page, "#ranking th[data-key=peak_mem_gb]")
    peaks = [float(v) for v in column(page, "peak_mem_gb")]
    assert peaks == sorted(peaks) and len(set(peaks)) > 1
    click(page, "#ranking th[data-key=layout_short]")
    layouts = column(page, "layout_short")
    assert layouts == sorted(layouts, key=str.lower)

    page.evaluate("window.scrollTo(0, 0)")
    shot = tmp_path / "report.png"
    page.screenshot(shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 100_000
    if os.environ.get("AUTOTUNE_SCREENSHOT_DIR"):
        folder = Path(os.environ["AUTOTUNE_SCREENSHOT_DIR"])
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, folder / "report.png")
    # Offline: the page fetched nothing but itself.
    urls = [e["params"]["request"]["url"] for e in browser.events
            if e.get("method") == "Network.requestWillBeSent" and e.get("sessionId") == page.session]
    assert all(url.startswith(("file:", "data:", "blob:")) for url in urls), urls
    assert page.errors() == []


def test_a_script_in_the_model_name_is_only_text(tmp_path, browser):
    name = "<script>alert(1)</script>"
    write_reports(make_study(tmp_path, model_name=name), tmp_path)
    page = browser.open((tmp_path / "report.html").as_uri())
    page.wait_until("document.querySelectorAll('.chart .main-svg').length > 0")
    assert page.evaluate("document.querySelector('h1').textContent") == f"autotune: {name} on 16 GPUs"
    assert page.evaluate("document.title") == f"autotune: {name} on 16 GPUs"
    assert not [e for e in browser.events if e.get("method") == "Page.javascriptDialogOpening"]
    assert page.errors() == []


def test_the_report_of_a_real_sweep_loads_draws_and_sorts(tmp_path, browser):
    """A small real sweep (three measured layouts of tiny on 2 processes, the leader measured
    again) as the user gets it from `autotune run`: the page loads with no console error, its
    charts draw the measured trials, and the ranking sorts on a click."""
    out = tmp_path / "sweep"
    run = subprocess.run([sys.executable, "-m", "autotune", "run", "--model", "tiny", "--gpus", "2",
                          "--space", "quick", "--sampler", "grid", "--trials", "3", "--steps", "1", "--warmup", "0",
                          "--confirm", "1", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr
    frame = pandas.read_csv(out / "trials.csv")
    complete = int((frame["status"] == "complete").sum())
    assert len(frame) == 3 and complete >= 2, frame[["status", "reason", "error"]]
    page = browser.open((out / "report.html").as_uri())
    assert page.wait_until("document.querySelectorAll('#chart-throughput .trace .point').length == 3")
    for chart in ("throughput", "memory", "comm", "predicted", "history"):
        assert page.evaluate(f"document.querySelectorAll('#chart-{chart} .trace .point').length") > 0, chart
    values = [float(v) for v in column(page, "tokens_per_s")]
    assert len(values) == complete and values == sorted(values, reverse=True)
    click(page, "#ranking th[data-key=tokens_per_s]")
    assert [float(v) for v in column(page, "tokens_per_s")] == sorted(values)
    shot = tmp_path / "report-real.png"
    page.screenshot(shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("AUTOTUNE_SCREENSHOT_DIR"):
        folder = Path(os.environ["AUTOTUNE_SCREENSHOT_DIR"])
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, folder / "report-real.png")
    assert page.errors() == []
