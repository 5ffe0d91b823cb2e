"""The history database: schema, tiers, retention and size bound (docs/history.md).

Three tiers hold the same figures at three resolutions, all written by every sample (so a crash can
never leave one behind another): tier 0 in 10-second buckets, kept ``fine_keep`` seconds (2 days),
tier 1 in 5-minute buckets and tier 2 in hourly ones, both kept ``retention`` seconds (a year).  Long
reports read whole hours from tier 2 and the partial hours at their edges from tier 1.  A bucket's row sums what its
samples accounted: ``seconds`` observed, ``util_s`` (utilisation × seconds), ``energy_j`` (watts ×
seconds), ``idle_s`` (seconds under 5 %), so averages over any range are exact sums divided.

The database lives in the daemon's state directory (``history.sqlite``), created with mode 0600:
who used what is private (docs/history.md, Privacy).  WAL mode, ``synchronous=NORMAL``: a commit
survives the process being killed (only a power cut may lose the last commits).
"""

# Imports inside functions: start-up (gpusd report imports this module).
from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

FINE, COARSE, HOURLY = 0, 1, 2
# seconds per bucket of each tier
STEP = {FINE: 10, COARSE: 300, HOURLY: 3600}
TIERS = (FINE, COARSE, HOURLY)
# the version SCHEMA creates; meta('schema') holds a database's own
SCHEMA_VERSION = 2
# percent: a GPU under this is idle (the same 5 % as a free GPU's rule)
IDLE_UTIL = 5.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS gpus(
    id INTEGER PRIMARY KEY, uuid TEXT UNIQUE NOT NULL, host TEXT, idx INTEGER, model TEXT,
    mem_total INTEGER, first REAL, last REAL);
CREATE TABLE IF NOT EXISTS series(
    tier INTEGER NOT NULL, gpu INTEGER NOT NULL, ts INTEGER NOT NULL,
    seconds REAL NOT NULL, util_s REAL NOT NULL, util_n REAL NOT NULL, mem_s REAL NOT NULL,
    mem_max INTEGER, power_s REAL NOT NULL, temp_max INTEGER, busy_s REAL NOT NULL, held_s REAL NOT NULL,
    PRIMARY KEY(tier, gpu, ts)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS usage(
    tier INTEGER NOT NULL, gpu INTEGER NOT NULL, ts INTEGER NOT NULL, kind TEXT NOT NULL, user TEXT NOT NULL,
    seconds REAL NOT NULL, util_s REAL NOT NULL, energy_j REAL NOT NULL, idle_s REAL NOT NULL,
    PRIMARY KEY(tier, ts, gpu, kind, user)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS jobs(
    id INTEGER PRIMARY KEY, kind TEXT NOT NULL, key TEXT UNIQUE NOT NULL, uid INTEGER, user TEXT,
    command TEXT, gpus TEXT NOT NULL, start REAL NOT NULL, last REAL NOT NULL, ended REAL,
    gpu_s REAL NOT NULL DEFAULT 0, util_s REAL NOT NULL DEFAULT 0, energy_j REAL NOT NULL DEFAULT 0,
    idle_s REAL NOT NULL DEFAULT 0, peak_mem INTEGER, idle_flagged REAL, released REAL, timed_out REAL);
CREATE INDEX IF NOT EXISTS jobs_last ON jobs(last);
CREATE INDEX IF NOT EXISTS jobs_open ON jobs(ended) WHERE ended IS NULL;
"""


# Schema migrations: version -> the statements that bring a database of the version before it to it.
# A change to the schema bumps SCHEMA_VERSION, puts the change in SCHEMA (new databases) and here
# (existing ones).  :func:`migrate` runs the steps a database lacks, in order, in one transaction.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    # when a job's --time ran out (gpusd run --time)
    2: ("ALTER TABLE jobs ADD COLUMN timed_out REAL",),
}


class SchemaError(sqlite3.DatabaseError):
    """The history database is of a schema this gpusd cannot use: written by a newer gpusd, or (for a
    read-only reader) by an older one that no daemon has migrated yet, or its version is unreadable."""


@dataclass
class Retention:
    """How long each tier is kept, and the bound on the file's size (docs/history.md)."""

    # seconds of 10 s buckets
    fine_keep: float = 2 * 86400.0
    # seconds of 5 min buckets and of job records
    retention: float = 365 * 86400.0
    # the file's size bound: the oldest coarse data goes first
    max_bytes: int = 1 << 30

    def validate(self) -> None:
        if not 3600 <= self.fine_keep <= 30 * 86400:
            raise ConfigError("the fine history must be kept between 1 hour and 30 days")
        if not 86400 <= self.retention <= 10 * 365 * 86400:
            raise ConfigError("--retention must be between 1 and 3650 days")
        if not 1 << 20 <= self.max_bytes <= 1 << 40:
            raise ConfigError("--history-size must be between 1 MiB and 1 TiB")


def connect(path: Path | str, readonly: bool = False) -> sqlite3.Connection:
    """Open (creating when writable) the history database.  A reader opens it read-only: it can
    never change, lock out or grow the daemon's file.  Raises ``sqlite3.Error`` or ``OSError``."""
    path = Path(path)
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0, check_same_thread=False)
        try:
            conn.execute("PRAGMA query_only=1")
            version = schema_version(conn)
            if version is not None and version != SCHEMA_VERSION:
                raise SchemaError(_mismatch(path, version, readonly=True))
        except BaseException:
            conn.close()
            raise
        return conn
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # created here, by us, 0600 (O_EXCL: never through a link someone else put in place)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.close(fd)
    elif path.is_symlink():
        raise OSError(f"{path} is a symbolic link: refusing to open it")
    conn = sqlite3.connect(str(path), timeout=10.0, check_same_thread=False, isolation_level=None)
    if conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 0 and not _has_tables(conn):
        # before the first table: lets the file shrink
        conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        migrate(conn, path)
    except BaseException:
        conn.close()
        raise
    return conn


def schema_version(conn: sqlite3.Connection) -> int | None:
    """The database's schema version (meta 'schema'); None for an empty database.  A database with
    tables but no version (none was ever written without one) reads as version 1."""
    if not _has_tables(conn):
        return None
    has_meta = conn.execute("SELECT count(*) FROM sqlite_master WHERE type='table' AND name='meta'").fetchone()[0]
    row = conn.execute("SELECT value FROM meta WHERE key='schema'").fetchone() if has_meta else None
    if row is None:
        return 1
    try:
        version = int(row[0])
    except (TypeError, ValueError):
        raise SchemaError(f"the history database has an unreadable schema version {str(row[0])[:20]!r}") from None
    if version < 1:
        raise SchemaError(f"the history database has an unreadable schema version {version}")
    return version


def _mismatch(path: Path | str, version: int, readonly: bool = False) -> str:
    if version > SCHEMA_VERSION:
        return (f"{path} was written by a newer gpusd (history schema {version}; this gpusd reads schema "
                f"{SCHEMA_VERSION} and older): upgrade gpusd, or move the file away to start a new history")
    return (f"{path} has history schema {version}, older than this gpusd's {SCHEMA_VERSION}: "
            + ("start the daemon once to migrate it" if readonly else "it is migrated when opened for writing"))


def migrate(conn: sqlite3.Connection, path: Path | str = "the history database") -> int:
    """Bring the database to :data:`SCHEMA_VERSION`: create it when empty, run the missing
    :data:`MIGRATIONS` in order when older (one transaction: all or nothing), refuse it with
    :class:`SchemaError` when newer (its data stays untouched).  Returns the version it had (0: new)."""
    version = schema_version(conn)
    if version is None:
        conn.executescript(SCHEMA)
        conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES('schema', ?)", (str(SCHEMA_VERSION),))
        return 0
    if version > SCHEMA_VERSION:
        raise SchemaError(_mismatch(path, version))
    if version < SCHEMA_VERSION:
        missing = [v for v in range(version + 1, SCHEMA_VERSION + 1) if v not in MIGRATIONS]
        if missing:
            raise SchemaError(f"no migration to history schema {missing[0]} (a bug in this gpusd)")
        with transaction(conn):
            for v in range(version + 1, SCHEMA_VERSION + 1):
                for statement in MIGRATIONS[v]:
                    conn.execute(statement)
            conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES('schema', ?)", (str(SCHEMA_VERSION),))
        import logging

        logging.getLogger(__name__).info("history database %s migrated from schema %d to %d", path, version,
                                         SCHEMA_VERSION)
    # every table and index of this version exists (a no-op when they do)
    conn.executescript(SCHEMA)
    return version


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One explicit transaction (the connection is in autocommit mode: ``with conn`` alone would not
    begin one, and every statement would commit on its own)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        # A full disk (SQLITE_FULL) may fail a statement or the COMMIT itself, and SQLite may or may not
        # have rolled the transaction back already: a transaction left open would fail every later BEGIN
        # ("cannot start a transaction within a transaction") long after the disk has room again, and a
        # failed ROLLBACK must not hide the error that says why.
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        raise


def _has_tables(conn: sqlite3.Connection) -> bool:
    return int(conn.execute("SELECT count(*) FROM sqlite_master WHERE type='table'").fetchone()[0]) > 0


def prune(conn: sqlite3.Connection, now: float, keep: Retention) -> int:
    """Delete what retention says is too old, then, while the file is over its size bound, the
    oldest data (a day at a time, an hour at a time within the fine tier's two days).  Returns the
    rows deleted."""
    n = 0
    with transaction(conn):
        n += conn.execute("DELETE FROM series WHERE tier=? AND ts<?", (FINE, now - keep.fine_keep)).rowcount
        n += conn.execute("DELETE FROM usage WHERE tier=? AND ts<?", (FINE, now - keep.fine_keep)).rowcount
        for tier in (COARSE, HOURLY):
            n += conn.execute("DELETE FROM series WHERE tier=? AND ts<?", (tier, now - keep.retention)).rowcount
            n += conn.execute("DELETE FROM usage WHERE tier=? AND ts<?", (tier, now - keep.retention)).rowcount
        n += conn.execute("DELETE FROM jobs WHERE ended IS NOT NULL AND ended<?", (now - keep.retention,)).rowcount
    for _ in range(4000):
        if size_bytes(conn) <= keep.max_bytes:
            break
        oldest = conn.execute("SELECT min(ts) FROM series").fetchone()[0]
        if oldest is None:
            break
        # a day at a time while the 5-minute and hourly tiers reach back further than the fine one,
        # then an hour at a time (a bound smaller than two days of fine data)
        cut = oldest + (86400 if oldest < now - keep.fine_keep else 3600)
        with transaction(conn):
            n += conn.execute("DELETE FROM series WHERE ts<?", (cut,)).rowcount
            n += conn.execute("DELETE FROM usage WHERE ts<?", (cut,)).rowcount
            n += conn.execute("DELETE FROM jobs WHERE ended IS NOT NULL AND ended<?", (cut,)).rowcount
        conn.execute("PRAGMA incremental_vacuum")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    if n:
        conn.execute("PRAGMA incremental_vacuum")
    return n


def size_bytes(conn: sqlite3.Connection) -> int:
    """The database's size in use: pages × page size (the WAL file is checkpointed into it)."""
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    size = conn.execute("PRAGMA page_size").fetchone()[0]
    return int((pages - free) * size)
