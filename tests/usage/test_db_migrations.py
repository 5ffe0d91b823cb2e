"""The history database's schema version is read: a database is migrated forward step by step (all or
nothing), and one written by a newer gpusd is refused with a clear message, its data untouched."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from gpusd.usage import db


def _with_a_job(path: Path) -> None:
    conn = db.connect(path)
    conn.execute("INSERT INTO jobs(kind, key, user, gpus, start, last) VALUES('process', 'k', 'alice', '[]', 1, 2)")
    conn.close()


def _version(path: Path) -> str:
    with sqlite3.connect(path) as c:
        return str(c.execute("SELECT value FROM meta WHERE key='schema'").fetchone()[0])


def test_a_new_database_gets_this_version(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    db.connect(path).close()
    assert _version(path) == str(db.SCHEMA_VERSION)
    conn = db.connect(path)  # opening again changes nothing
    assert db.schema_version(conn) == db.SCHEMA_VERSION
    conn.close()


def test_a_newer_database_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    _with_a_job(path)
    with sqlite3.connect(path) as c:
        c.execute("UPDATE meta SET value='99' WHERE key='schema'")
    for readonly in (False, True):
        with pytest.raises(db.SchemaError, match="written by a newer gpusd .*schema 99.*upgrade gpusd"):
            db.connect(path, readonly=readonly)
    assert _version(path) == "99"
    with sqlite3.connect(path) as c:
        assert c.execute("SELECT user FROM jobs").fetchall() == [("alice",)]


def test_gpusd_report_on_a_newer_database_is_one_clear_line(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    _with_a_job(path)
    with sqlite3.connect(path) as c:
        c.execute("UPDATE meta SET value='7' WHERE key='schema'")
    env = {**os.environ, "GPUSD_STATE_DIR": str(tmp_path / "state")}
    r = subprocess.run([sys.executable, "-m", "gpusd", "report", "--db", str(path)], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "written by a newer gpusd (history schema 7" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_an_older_database_is_migrated_forward_keeping_its_data(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "h.sqlite"
    _with_a_job(path)  # written at this version, V
    v = db.SCHEMA_VERSION
    monkeypatch.setattr(db, "SCHEMA_VERSION", v + 2)
    monkeypatch.setattr(db, "MIGRATIONS", {**db.MIGRATIONS, v + 1: ("ALTER TABLE jobs ADD COLUMN note TEXT",),
                                           v + 2: ("UPDATE jobs SET note='from v1'",
                                                   "CREATE INDEX jobs_user ON jobs(user)")})
    with pytest.raises(db.SchemaError, match=f"older than this gpusd's {v + 2}: start the daemon once"):
        db.connect(path, readonly=True)  # a reader does not migrate
    conn = db.connect(path)
    assert conn.execute("SELECT user, note FROM jobs").fetchall() == [("alice", "from v1")]
    assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name='jobs_user'").fetchone()[0] == 1
    conn.close()
    assert _version(path) == str(v + 2)
    db.connect(path, readonly=True).close()  # and now readers read it


def test_a_version_1_database_gets_the_time_out_column(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    with sqlite3.connect(path) as c:  # the schema of version 1, as 0.4 wrote it
        c.executescript(db.SCHEMA.replace(", timed_out REAL", ""))
        c.execute("INSERT INTO meta(key, value) VALUES('schema', '1')")
        c.execute("INSERT INTO jobs(kind, key, user, gpus, start, last) VALUES('lease', 'k', 'alice', '[]', 1, 2)")
    conn = db.connect(path)
    assert conn.execute("SELECT user, timed_out FROM jobs").fetchall() == [("alice", None)]
    conn.close()
    assert _version(path) == str(db.SCHEMA_VERSION)


def test_a_failing_migration_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "h.sqlite"
    _with_a_job(path)
    v = db.SCHEMA_VERSION
    monkeypatch.setattr(db, "SCHEMA_VERSION", v + 1)
    monkeypatch.setattr(db, "MIGRATIONS", {**db.MIGRATIONS, v + 1: ("ALTER TABLE jobs ADD COLUMN note TEXT",
                                                                     "UPDATE no_such_table SET x=1")})
    with pytest.raises(sqlite3.OperationalError):
        db.connect(path)
    assert _version(path) == str(v)
    with sqlite3.connect(path) as c:
        assert "note" not in [row[1] for row in c.execute("PRAGMA table_info(jobs)")]
