"""Numbers of `gpusd report` that must not mislead (issue 18, item 10 and 9): the period's edges
count only what lies inside them, a GPU that ran is never "never used", one format per column, and
the title says which part of the period has data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpusd.cli import main
from history_helpers import HOUR, T0, record_scenario

SCENARIO = {"hostname": "lab-node-2", "gpus": [
    {"model": "A100-80GB", "util": {"min": 20, "max": 47}},  # busy, its processes out of sight (a container)
    {"model": "A100-80GB", "util": 0},  # really idle
]}


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("numbers")
    spec = d / "scenario.json"
    spec.write_text(json.dumps(SCENARIO))
    path = d / "history.sqlite"
    record_scenario(path, hours=600 / HOUR, interval=1.0, spec=spec)  # 10 minutes, a sample a second
    return path


def report(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["report", "--by", "gpu", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out


def test_the_edges_of_the_period_count_only_their_part_inside_it(db: Path, capsys) -> None:
    """90 s that start and end inside 10-s buckets are 90 s per GPU, not 90 s plus the rest of the
    first bucket (--since 90s used to give 97.9 s)."""
    code, out = report(capsys, "--db", str(db), "--from", str(T0 + 105), "--to", str(T0 + 195), "--format", "json")
    assert code == 0
    r = json.loads(out)
    assert r["totals"]["gpu_hours_observed"] * 3600 == pytest.approx(2 * 90, abs=2)


def test_a_gpu_that_ran_at_20_to_47_percent_is_not_never_used(db: Path, capsys) -> None:
    code, out = report(capsys, "--db", str(db), "--from", str(T0), "--to", str(T0 + 600), "--format", "json")
    assert code == 0
    assert [g["index"] for g in json.loads(out)["never_used"]] == [1]


def test_one_format_per_column_and_the_period_with_data(db: Path, capsys) -> None:
    """A week asked of a daemon that recorded 10 minutes: the title says where the data is."""
    code, out = report(capsys, "--db", str(db), "--from", str(T0 - 7 * 24 * HOUR), "--to", str(T0 + 600))
    assert code == 0
    title = out.splitlines()[0]
    assert "data from" in title, title
    header, _, *rows = [line.split() for line in out.split("\n\n")[1].splitlines()]
    util = [row[-2] for row in rows]  # the mean util column: a percentage everywhere
    assert all(u.endswith("%") for u in util), rows
    hours = [row[-5] for row in rows]  # GPU-h used: two decimals everywhere, whatever the size
    assert all(len(h.split(".")[1]) == 2 for h in hours), rows
    code, out = report(capsys, "--db", str(db), "--from", str(T0 - 7 * 24 * HOUR), "--to", str(T0 + 600),
                       "--format", "html")
    assert "data from" in out.split("</h1>")[0]


def test_since_90s_is_90_seconds(tmp_path: Path, capsys) -> None:
    """The case of the issue: `report --since 90s` on a recording up to now gave 97.9 s per GPU."""
    import time

    spec = tmp_path / "scenario.json"
    spec.write_text(json.dumps(SCENARIO))
    path = tmp_path / "history.sqlite"
    t0 = time.time() - 600
    record_scenario(path, hours=600 / HOUR, interval=1.0, spec=spec, t0=t0)
    code, out = report(capsys, "--db", str(path), "--since", "90s", "--format", "json")
    assert code == 0
    seconds = json.loads(out)["totals"]["gpu_hours_observed"] * 3600 / 2
    assert seconds == pytest.approx(90, abs=3), seconds
