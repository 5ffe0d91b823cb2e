"""The shipped alert and recording rules (docs/prometheus-rules.yml): Prometheus's own checker accepts
them, and its rule unit tests (tests/daemon/prometheus/rules-test.yml) see each alert fire on the
series that should fire it and stay quiet otherwise."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests_paths import REPO

RULES = REPO / "docs" / "prometheus-rules.yml"
UNIT = Path(__file__).parent / "prometheus" / "rules-test.yml"

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None,
                                reason="no promtool (apt-get install prometheus; .ci/run does)")


def test_promtool_accepts_the_rules() -> None:
    r = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_fires_in_promtools_unit_tests() -> None:
    r = subprocess.run(["promtool", "test", "rules", UNIT.name], cwd=UNIT.parent, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    tested = {line.split(":", 1)[1].strip() for line in UNIT.read_text().splitlines()
              if line.strip().startswith("alertname:")}
    shipped = {line.split(":", 1)[1].strip() for line in RULES.read_text().splitlines()
               if line.strip().startswith("- alert:")}
    assert shipped and shipped <= tested, f"alerts without a unit test: {sorted(shipped - tested)}"


def test_the_dashboards_counts_read_0_not_no_data_when_nothing_is_leased(tmp_path: Path) -> None:
    """Each count on gpusd's dashboard (a stat panel) evaluates to 0 on a fleet with nothing leased,
    nothing idle, nothing unhealthy and no alert, where a bare ``count()`` gives no sample ("No data")."""
    import json

    board = json.loads((REPO / "docs" / "grafana-gpusd.json").read_text())
    counts = [(p["title"], t["expr"]) for p in board["panels"] if p.get("type") == "stat"
              for t in p.get("targets", []) if "count(" in t.get("expr", "")]
    assert len(counts) >= 4
    gpu = 'host="n",uuid="GPU-{i}",index="{i}",model="A100",instance="n:15000",job="gpusd"'
    series = []
    for i in range(2):  # two busy, healthy GPUs without a lease
        for name, value in (("gpusd_gpu_leases", 0), ("gpusd_gpu_processes", 1), ("gpusd_gpu_healthy", 1),
                            ("gpusd_gpu_info", 1)):
            series.append({"series": f"{name}{{{gpu.format(i=i)}}}", "values": f"{value}x5"})
    series.append({"series": 'gpusd_host_info{host="n",instance="n:15000",job="gpusd"}', "values": "1x5"})
    series.append({"series": 'gpusd_threshold_active{host="n",instance="n:15000",job="gpusd",rule="t"}',
                   "values": "0x5"})
    expected = {"Idle GPUs (no process, no lease)": 0, "Leased GPUs": 0, "Unhealthy GPUs": 0, "Active alerts": 0,
                "GPUs": 2, "Hosts": 1}
    tests = [{"expr": expr.replace('{instance=~"$instance", host=~"$host"}', ""), "eval_time": "3m",
              "exp_samples": [{"labels": "{}", "value": expected[title]}]} for title, expr in counts]
    spec = tmp_path / "counts-test.yml"
    spec.write_text(json.dumps({"tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}]}))
    r = subprocess.run(["promtool", "test", "rules", spec.name], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
