"""Several workers on one shared study: the claim, heartbeats and retries, bad input.

Most tests run `autotune run` / `autotune worker` with fake trials (tests/support/fake_trials.py):
the claim and the retry are properties of the study, and a fake trial lets a test race
twenty claims in seconds. The last test runs the real thing: two processes measure the
quick space on PostgreSQL, one is killed mid-trial, and no password leaks anywhere.
"""

import collections
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
from optuna.trial import TrialState

from autotune.study.controller import MAX_RETRIES, RetryStaleTrial
from autotune.study.storage import open_storage, redact, redact_text
from support.postgres import with_password

FAKE = str(Path(__file__).parent / "support" / "fake_trials.py")
QUICK_4 = ["--model", "tiny", "--gpus", "4", "--space", "quick", "--sampler", "grid"]  # 20 layouts
QUICK_4_LAYOUTS = 20
PASSWORD = "pa:ss@w/rd-9"  # characters that URLs percent-encode


@pytest.fixture(params=["postgresql", "journal"])
def shared_storage(request, tmp_path):
    """A URL of each kind of shared storage (the database is made and dropped per test)."""
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_db")[1]
    return f"journal:{tmp_path / 'study.journal'}"


def start(args, out, env=None, script=FAKE):
    command = [sys.executable, script, *args, "--out", str(out)] if script else \
        [sys.executable, "-m", "autotune", *args, "--out", str(out)]
    log = open(f"{out}.log", "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


def load(url, name="s"):
    return optuna.load_study(study_name=name, storage=open_storage(url)).get_trials()


def wait_for(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except KeyError:  # the study does not exist yet
            pass
        time.sleep(0.3)
    return False


def outcomes_by_layout(trials):
    """{layout: [trials that hold an outcome for it]}."""
    found = collections.defaultdict(list)
    for t in trials:
        if "status" in t.user_attrs and t.user_attrs.get("reason") != "interrupted":
            found[t.user_attrs["layout"]].append(t)
    return found


def race(url, tmp_path, env):
    """`run` and `worker` started together on one study; their exit codes and the trials."""
    env = {"FAKE_CHOOSE_S": "0.2", **env}
    first = start(["run", *QUICK_4, "--exhaustive", "--storage", url, "--study-name", "s", "--heartbeat", "2"],
                  tmp_path / "a", env)
    assert wait_for(lambda: load(url), 60), Path(f"{tmp_path / 'a'}.log").read_text()
    second = start(["worker", "--storage", url, "--study-name", "s"], tmp_path / "b", env)
    codes = [first.wait(timeout=180), second.wait(timeout=180)]
    return codes, load(url)


def test_two_workers_claim_every_layout_once(postgres_db, tmp_path):
    codes, trials = race(postgres_db[1], tmp_path, {})
    assert codes == [0, 0], Path(f"{tmp_path / 'b'}.log").read_text()
    assert len(trials) == QUICK_4_LAYOUTS
    found = outcomes_by_layout(trials)
    assert len(found) == QUICK_4_LAYOUTS and all(len(ts) == 1 for ts in found.values())
    workers = collections.Counter(t.user_attrs["worker"] for t in trials)
    assert len(workers) == 2, workers  # both took part in the race


def test_without_the_claim_two_workers_measure_layouts_twice(postgres_db, tmp_path):
    """The control: the same race with the claim disabled does measure layouts twice, so
    the test above would see it."""
    codes, trials = race(postgres_db[1], tmp_path, {"FAKE_NO_CLAIM": "1"})
    assert codes == [0, 0]
    found = outcomes_by_layout(trials)
    assert any(len(ts) > 1 for ts in found.values())


def test_a_dead_workers_trial_is_retried_by_another(shared_storage, tmp_path):
    """A worker hangs in its first trial while a second one measures every other layout;
    the second waits (the trial still beats), the first is SIGKILLed, and once its trial
    goes stale the second fails it, runs it again and exits."""
    url = shared_storage
    doomed = start(["run", *QUICK_4, "--exhaustive", "--storage", url, "--study-name", "s", "--heartbeat", "2"],
                   tmp_path / "a", {"FAKE_TRIAL_HANG": "1"})

    def running():
        return [t for t in load(url) if t.state == TrialState.RUNNING and "layout" in t.user_attrs]
    assert wait_for(running, 60), Path(f"{tmp_path / 'a'}.log").read_text()
    (dead,) = running()
    survivor = start(["worker", "--storage", url, "--study-name", "s"], tmp_path / "b")
    log = Path(f"{tmp_path / 'b'}.log")
    assert wait_for(lambda: "waiting: nothing left to start while trials" in log.read_text(), 120), log.read_text()
    assert survivor.poll() is None  # it waits while the hung trial beats
    doomed.send_signal(signal.SIGKILL)
    doomed.wait()
    assert survivor.wait(timeout=120) == 0, log.read_text()

    trials = load(url)
    dead = next(t for t in trials if t.number == dead.number)
    assert dead.state == TrialState.FAIL and "status" not in dead.user_attrs  # failed as stale
    (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == dead.number]
    assert retry.user_attrs["layout"] == dead.user_attrs["layout"]
    assert retry.user_attrs["status"] == "complete" and retry.user_attrs["worker"].endswith(f":{survivor.pid}")
    found = outcomes_by_layout(trials)
    assert len(found) == QUICK_4_LAYOUTS and all(len(ts) == 1 for ts in found.values())


def test_a_layout_that_keeps_killing_its_workers_fails_for_good(tmp_path):
    """After MAX_RETRIES retries a stale trial is not queued again: its layout gets
    failed/crash, so no worker is handed it forever."""
    study = optuna.create_study(storage=open_storage(f"journal:{tmp_path / 'j'}"))
    dist = {"tp": optuna.distributions.CategoricalDistribution([1, 2])}
    attrs = {"layout": "tp=2,...", "worker": "node7:123"}
    stale = optuna.trial.create_trial(state=TrialState.FAIL, params={"tp": 2}, distributions=dist, user_attrs=attrs,
                                      system_attrs={"failed_trial": 0, "retry_history": list(range(MAX_RETRIES))})
    study.add_trial(stale)
    RetryStaleTrial()(study, study.get_trials()[-1])
    last = study.get_trials()[-1]
    assert last.state == TrialState.FAIL and last.user_attrs["status"] == "failed"
    assert last.user_attrs["reason"] == "crash" and "node7:123" in last.user_attrs["error"]
    assert last.user_attrs["layout"] == "tp=2,..."
    fresh = optuna.trial.create_trial(state=TrialState.FAIL, params={"tp": 1}, distributions=dist,
                                      user_attrs={"layout": "tp=1,..."})
    study.add_trial(fresh)
    RetryStaleTrial()(study, study.get_trials()[-1])
    queued = study.get_trials()[-1]
    assert queued.state == TrialState.WAITING and queued.user_attrs["layout"] == "tp=1,..."


def test_redaction_hides_every_form_of_the_password():
    url = "postgresql://me:p%40ss@db:5432/x?sslpassword=k3y&sslmode=require"
    assert redact(url) == "postgresql://me:***@db:5432/x?sslpassword=***&sslmode=require"
    said = redact_text("could not connect as me:p%40ss (password p@ss, key k3y)", url)
    assert "p%40ss" not in said and "p@ss" not in said and "k3y" not in said
    assert redact("journal:/shared/sweep.journal") == "journal:/shared/sweep.journal"


def one_error_line(result):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def worker(*args):
    return subprocess.run([sys.executable, "-m", "autotune", "worker", *args], capture_output=True, text=True,
                          timeout=120)


def test_workers_started_together_on_a_fresh_database_all_open_it(postgres_db):
    """Optuna creates its tables on first open; eight openers released at once on an empty
    PostgreSQL database (threads: the race is in the server's catalogue, not in Python)
    each get a storage. Without the schema lock some fail with a duplicate key in
    pg_type, as a worker did when started beside its controller."""
    import threading

    url, openers = postgres_db[1], 8
    barrier, opened, errors = threading.Barrier(openers), [], []

    def open_together():
        barrier.wait()
        try:
            opened.append(open_storage(url))
        except Exception as e:  # each failure is the finding
            errors.append(str(e))

    threads = [threading.Thread(target=open_together, daemon=True) for _ in range(openers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an opener still waits: the lock was never released"
    assert errors == [] and len(opened) == openers


def test_worker_bad_input_is_one_line_without_the_password(postgres_db, tmp_path):
    url = with_password(postgres_db[1], PASSWORD)
    encoded = url.split("://", 1)[1].split("@")[0].split(":", 1)[1]
    assert encoded != PASSWORD  # the URL holds the percent-encoded form; neither may show
    missing = one_error_line(worker("--storage", url, "--study-name", "nope", "--out", str(tmp_path)))
    assert "--study-name" in missing and "nope" in missing
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    unreachable = one_error_line(worker("--storage", f"postgresql://me:{encoded}@127.0.0.1:{port}/db",
                                        "--study-name", "s"))
    assert "--storage postgresql://me:***@127.0.0.1" in unreachable
    unknown = one_error_line(worker("--storage", f"mysql://me:{encoded}@host/db", "--study-name", "s"))
    assert "--storage" in unknown and "journal:PATH" in unknown
    no_folder = one_error_line(worker("--storage", f"journal:{tmp_path / 'no' / 'j'}", "--study-name", "s"))
    assert "no such folder" in no_folder
    for line in (missing, unreachable, unknown):
        assert PASSWORD not in line and encoded not in line


def descendants(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_real_sweep_two_workers_one_killed_mid_trial(postgres_db, tmp_path):
    """`run` and `worker` measure the quick space on 2 GPUs together over PostgreSQL; the
    worker is SIGKILLed mid-trial; `run` retries its trial; every layout ends with one
    outcome, the trials finished before the kill are kept, and the password (in a URL)
    appears in no output, file or stored attribute."""
    url = with_password(postgres_db[1], PASSWORD)
    encoded = url.split("://", 1)[1].split("@")[0].split(":", 1)[1]
    common = ["--storage", url, "--study-name", "e2e"]
    main = start(["run", "--model", "tiny", "--gpus", "2", "--space", "quick", "--exhaustive", "--steps", "1",
                  "--warmup", "0", "--heartbeat", "2", "--confirm", "0", *common], tmp_path / "a", script=None)
    plain = postgres_db[1]
    assert wait_for(lambda: load(plain, "e2e"), 90), Path(f"{tmp_path / 'a'}.log").read_text()
    # The helper's trials sleep 10 s: it is killed inside one it started moments before.
    helper = start(["worker", *common], tmp_path / "b", {"AUTOTUNE_FAULT": "slow rank=0 seconds=10"}, script=None)
    mine = f"{socket.gethostname()}:{helper.pid}"

    def helper_just_started_its_second_trial():
        trials = [t for t in load(plain, "e2e") if t.user_attrs.get("worker") == mine]
        fresh = [t for t in trials if t.state == TrialState.RUNNING and
                 (datetime.datetime.now() - t.datetime_start).total_seconds() < 5]
        return fresh and any(t.state.is_finished() for t in trials)
    assert wait_for(helper_just_started_its_second_trial, 300), Path(f"{tmp_path / 'b'}.log").read_text()
    children = descendants(helper.pid)
    helper.send_signal(signal.SIGKILL)
    helper.wait()
    _, alive = psutil.wait_procs(children, timeout=20)  # its torchrun and ranks die with it
    assert alive == []
    trials = load(plain, "e2e")
    (killed,) = [t for t in trials if t.state == TrialState.RUNNING and t.user_attrs.get("worker") == mine]
    before = {t.number: (t.state, t.value, dict(t.user_attrs)) for t in trials if t.state.is_finished()}

    assert main.wait(timeout=400) == 0, Path(f"{tmp_path / 'a'}.log").read_text()
    trials = load(plain, "e2e")
    found = outcomes_by_layout(trials)
    assert len(found) == 10 and all(len(ts) == 1 for ts in found.values())  # the quick space on 2 GPUs
    assert {t.user_attrs["worker"] for (t,) in found.values()} == {mine, f"{socket.gethostname()}:{main.pid}"}
    after = {t.number: t for t in trials}
    for number, (state, value, attrs) in before.items():  # nothing finished is lost or changed
        assert (after[number].state, after[number].value, after[number].user_attrs) == (state, value, attrs)
    killed = after[killed.number]
    assert killed.state == TrialState.FAIL and "status" not in killed.user_attrs
    (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == killed.number]
    assert retry.user_attrs["layout"] == killed.user_attrs["layout"] and retry.user_attrs["worker"] != mine
    assert retry.user_attrs["status"] in ("complete", "pruned") and retry.user_attrs["losses"]  # measured

    study = optuna.load_study(study_name="e2e", storage=open_storage(plain))
    stored = json.dumps(study.user_attrs) + json.dumps([[t.user_attrs, t.system_attrs] for t in trials])
    texts = {"stored study": stored}
    for folder in (tmp_path / "a", tmp_path / "b"):
        texts[f"{folder}.log"] = Path(f"{folder}.log").read_text()
        texts.update({str(p): p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file()})
    assert any(name.endswith("report.html") for name in texts) and any(name.endswith("trials.csv") for name in texts)
    for name, text in texts.items():
        assert PASSWORD not in text and encoded not in text, f"the password shows in {name}"
