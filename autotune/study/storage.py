"""Where a study lives, and the locks its workers share.

    sqlite:///PATH                          one machine (the default: study.db in --out)
    postgresql://USER:PASSWORD@HOST/DB      several machines, through psycopg2
    journal:PATH                            several machines sharing a filesystem: Optuna's
                                            JournalStorage on a file (with its own file lock)

Shared storages get Optuna's heartbeats: each running trial records one every
`heartbeat_s` seconds, and a running trial whose last beat is older than the grace
period (GRACE_HEARTBEATS x heartbeat_s) is stale: its worker died (the journal's
heartbeats: optuna_compat.py).

The claim: two workers may pick the same untaken layout at the same moment, so the
step from "which layouts are untaken" to "this trial's layout attribute is written"
runs under a lock held by one worker of the study at a time: a PostgreSQL advisory
lock (released by the server if the worker dies), or a file lock next to the SQLite
or journal file.

A URL may hold a password: `redact` and `redact_text` are the only forms of it that
reach a message, a log or a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import urllib.parse
import warnings
from pathlib import Path

import optuna
import sqlalchemy
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend

from autotune.errors import UsageError
from autotune.study.optuna_compat import JournalHeartbeatStorage

GRACE_HEARTBEATS = 4  # a trial is stale after this many missed heartbeats
JOURNAL_PREFIX = "journal:"
SCHEMES = "sqlite:///PATH, postgresql://USER:PASSWORD@HOST:PORT/DB or journal:PATH"


# -- credentials ----------------------------------------------------------------------------

def secrets(url: str) -> list[str]:
    """The parts of a URL never to show: its password, and any password-like query value
    (libpq also reads ?password=...), in plain and in percent-encoded form."""
    if url.startswith(JOURNAL_PREFIX) or "://" not in url:
        return []
    parsed = urllib.parse.urlsplit(url)
    found = [parsed.password] if parsed.password else []
    found += [value for key, value in urllib.parse.parse_qsl(parsed.query) if "password" in key.lower()]
    out = set()
    for secret in found:
        out.update({secret, urllib.parse.unquote(secret), urllib.parse.quote(secret, safe="")})
    return sorted((s for s in out if s), key=len, reverse=True)


def redact_text(text: str, url: str | None) -> str:
    """`text` with every secret of `url` replaced by ***."""
    for secret in secrets(url) if url else []:
        text = text.replace(secret, "***")
    return text


def redact(url: str | None) -> str:
    """The URL as it may be shown: postgresql://user:***@host/db."""
    return redact_text(url, url) if url else ""


# -- opening a storage ----------------------------------------------------------------------

def kind(url: str) -> str:
    """sqlite, postgresql or journal; anything else is bad input."""
    if url.startswith(JOURNAL_PREFIX):
        if not url[len(JOURNAL_PREFIX):]:
            raise UsageError("--storage: journal: needs a file path (journal:PATH)")
        return "journal"
    if url.startswith("sqlite:///"):
        return "sqlite"
    if url.startswith(("postgresql://", "postgresql+psycopg2://")):
        return "postgresql"
    raise UsageError(f"--storage: {redact(url)!r} is not one of {SCHEMES}")


def driver_url(url: str) -> str:
    """postgresql:// through psycopg2 (a dependency), which SQLAlchemy 2.1 no longer picks
    by default."""
    return "postgresql+psycopg2://" + url[len("postgresql://"):] if url.startswith("postgresql://") else url


def journal_path(url: str) -> Path:
    return Path(url[len(JOURNAL_PREFIX):]).expanduser()


def open_storage(url: str, heartbeat_s: int | None = None, stale_callback=None) -> BaseStorage:
    """An Optuna storage for `url`; with heartbeat_s, trials beat and stale ones are failed
    (and passed to stale_callback). A storage that cannot be opened is bad input, told in
    one line without the password."""
    heartbeat = {}
    if heartbeat_s is not None:
        heartbeat = {"heartbeat_interval": heartbeat_s, "grace_period": GRACE_HEARTBEATS * heartbeat_s,
                     "heartbeat_stale_trial_callback": stale_callback}
    how = kind(url)
    try:
        if how == "journal":
            path = journal_path(url)
            if not path.parent.is_dir():
                raise UsageError(f"--storage: journal file {path}: no such folder {path.parent}")
            backend = JournalFileBackend(str(path))
            if heartbeat:
                return JournalHeartbeatStorage(backend, **heartbeat)
            return JournalStorage(backend)
        engine_kwargs = {"pool_pre_ping": True} if how == "postgresql" else {}
        with optuna_quiet(), schema_lock(url):
            return RDBStorage(driver_url(url), engine_kwargs=engine_kwargs, **heartbeat)
    except UsageError:
        raise
    except Exception as e:  # the driver's own words, first line, without the password
        raise UsageError(f"--storage {redact(url)}: cannot open it ({one_line(e, url)})") from None


def advisory_key(name: str) -> int:
    """A signed 64-bit PostgreSQL advisory-lock key for a lock's name (advisory locks are per
    database: the schema's and each study's claim have names of their own)."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


SCHEMA_LOCK_KEY = advisory_key("autotune-schema")


@contextlib.contextmanager
def schema_lock(url: str):
    """On PostgreSQL, one process at a time opens the storage. RDBStorage creates Optuna's
    tables when they are missing, and two workers started together on a fresh database
    both create them: the second fails on PostgreSQL's catalogue (duplicate key in
    pg_type). Under the lock the second finds the tables made. A SQLite study has one
    controller (workers share PostgreSQL or a journal); the journal has no schema.

    The lock is the session's: closing the connection (NullPool: really closed) releases it,
    also when the server has dropped the session, so no unlock can fail over the storage's
    own error. Not re-entrant: each call is a session of its own."""
    if kind(url) != "postgresql":
        yield
        return
    engine = sqlalchemy.create_engine(driver_url(url), poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": SCHEMA_LOCK_KEY})
            yield
    finally:
        engine.dispose()


def one_line(error: BaseException, url: str) -> str:
    text = str(error).strip().splitlines()
    return redact_text(text[0] if text else type(error).__name__, url)


@contextlib.contextmanager
def optuna_quiet():
    """Silence Optuna's ExperimentalWarning for the features autotune relies on on purpose
    (heartbeats, the retry callback)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


# -- the claim ------------------------------------------------------------------------------

class Claim:
    """One worker of a study at a time may choose and claim a layout.

    acquire() blocks until this worker holds it; release() is harmless when not held,
    so the code that writes the layout and the code that ends the trial may both call it."""

    def __init__(self, url: str, study_name: str):
        self.url = url
        self.study_name = study_name
        self.held = False
        self._file = None
        self._connection = None

    def acquire(self) -> None:
        if self.held:
            return
        if kind(self.url) == "postgresql":
            try:
                self._advisory_lock()
            except sqlalchemy.exc.OperationalError:  # the idle session was dropped during a trial: reconnect
                self._connection = None
                self._advisory_lock()
        else:
            self._file = open(self.lock_path(), "a")
            fcntl.flock(self._file, fcntl.LOCK_EX)
        self.held = True

    def _advisory_lock(self) -> None:
        if self._connection is None:  # one session, kept: the lock belongs to the session
            engine = sqlalchemy.create_engine(driver_url(self.url), poolclass=sqlalchemy.pool.NullPool)
            self._connection = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        self._connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": self.key()})

    def release(self) -> None:
        if not self.held:
            return
        if self._connection is not None:
            self._connection.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"), {"key": self.key()})
        else:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
        self.held = False

    def close(self) -> None:
        self.release()
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def key(self) -> int:
        """This study's advisory-lock key."""
        return advisory_key(f"autotune-claim:{self.study_name}")

    def lock_path(self) -> str:
        """A hidden file next to the storage's file, so every worker that sees the storage
        sees the lock (one lock per file: the studies of one file take turns)."""
        if kind(self.url) == "journal":
            path = str(journal_path(self.url))
        else:
            path = sqlalchemy.engine.make_url(self.url).database
        folder, name = os.path.split(os.path.abspath(path))
        return os.path.join(folder, f".{name}.claim")


def load_study(folder: Path, storage: str | None = None, study_name: str | None = None) -> optuna.Study:
    """The autotune study in `folder`'s study.db (or in --storage), opened read-only in
    spirit: nothing is created, a missing study is bad input."""
    if storage is None:
        db = folder / "study.db"
        if not db.is_file():
            raise UsageError(f"DIR {folder}: no study here (no study.db; give --storage for a shared storage)")
        storage = f"sqlite:///{db}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url, storage = storage, open_storage(storage)  # bad input in one line, without the password
    try:
        names = optuna.get_all_study_names(storage)
    except Exception as e:  # a storage that opened but cannot be read: the driver's own words
        raise UsageError(f"--storage {redact(url)}: cannot read it ({one_line(e, url)})") from None
    if study_name is None:
        if len(names) != 1:
            found = f"it holds {', '.join(names)}" if names else "it holds none"
            raise UsageError(f"--study-name: needed to pick one study ({found})")
        study_name = names[0]
    elif study_name not in names:
        raise UsageError(f"--study-name: no study {study_name!r} in the storage "
                         f"(it holds {', '.join(names) or 'none'})")
    study = optuna.load_study(study_name=study_name, storage=storage)
    if "question" not in study.user_attrs:
        raise UsageError(f"--study-name: study {study_name!r} was not created by autotune run (no question)")
    return study
