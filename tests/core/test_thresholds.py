"""Threshold rules: syntax, config files, and the exceeded/cleared timeline the engine produces."""

from __future__ import annotations

import json

import pytest

from gpusd.errors import ConfigError
from gpusd.model import GpuInfo, HostSnapshot
from gpusd.thresholds import (
    ThresholdEngine,
    load_rules,
    load_rules_file,
    parse_rule,
)

GiB = 2**30


def host(t: float, *gpus: GpuInfo) -> HostSnapshot:
    return HostSnapshot(hostname="node-a", node_id="a" * 16, timestamp=t, gpus=list(gpus))


def gpu(index: int = 0, **kw: object) -> GpuInfo:
    base: dict[str, object] = {"uuid": f"GPU-{index}", "name": "NVIDIA A100", "memory_total": 80 * GiB,
                               "memory_used": GiB, "memory_free": 79 * GiB, "utilization_gpu": 10.0,
                               "temperature": 50, "power_draw": 100.0, "power_limit": 400.0}
    base.update(kw)
    return GpuInfo(index=index, **base)  # type: ignore[arg-type]


@pytest.mark.parametrize("text, metric, op, limit, unit, duration", [
    ("temperature>85", "temperature", ">", 85, "C", 0),
    ("temperature above 85 C", "temperature", ">", 85, "C", 0),
    ("utilization>90 for 60s", "utilization", ">", 90, "%", 60),
    ("util >= 90% for 1m", "utilization", ">=", 90, "%", 60),
    ("utilisation>90 for 500ms", "utilization", ">", 90, "%", 0.5),
    ("memory>95%", "memory", ">", 95, "%", 0),
    ("memory > 70GiB", "memory", ">", 70 * GiB, "B", 0),
    ("power>300W", "power", ">", 300, "W", 0),
    ("power>90%", "power", ">", 90, "%", 0),
    ("fan<10", "fan", "<", 10, "%", 0),
    ("processes>4 for 2h", "processes", ">", 4, "", 7200),
    ("lost", "lost", None, None, "", 0),
    ("lost for 30s", "lost", None, None, "", 30),
])
def test_rule_syntax(text, metric, op, limit, unit, duration):
    r = parse_rule(text)
    assert (r.metric, r.op, r.limit, r.unit, r.duration) == (metric, op, limit, unit, duration)
    assert parse_rule(r.text) == r  # the canonical form parses back to the same rule


def test_rule_names():
    assert parse_rule("hot: temperature>85").name == "hot"
    assert parse_rule("temperature>85").name == "temperature>85C"
    assert parse_rule("temperature>85", name="gpu-hot").name == "gpu-hot"


@pytest.mark.parametrize("text, says", [
    ("", "empty"),
    ("temp>>85", "expected METRIC OP VALUE"),
    ("voltage>3", "unknown metric 'voltage'"),
    ("temperature", "needs a comparison"),
    ("lost>1", "takes no comparison"),
    ("memory>150", "between 0 and 100"),
    ("utilization>120", "between 0 and 100"),
    ("temperature>85%", "does not fit temperature"),
    ("memory>70parsecs", "does not fit memory"),
    ("utilization>90 for 60 fortnights", "unknown duration unit"),
    ("utilization>90 for", "expected METRIC OP VALUE"),
])
def test_bad_rules_give_one_line_errors(text, says):
    with pytest.raises(ConfigError) as err:
        parse_rule(text)
    msg = str(err.value)
    assert says in msg and "\n" not in msg
    from gpusd.cli.exits import exit_code_for

    assert exit_code_for(err.value) == 2


def test_config_file(tmp_path):
    f = tmp_path / "rules.json"
    f.write_text(json.dumps({"thresholds": ["temperature>85", {"name": "busy", "rule": "utilization>90 for 60s"},
                                           "lost"]}))
    rules = load_rules_file(f)
    assert [r.name for r in rules] == ["temperature>85C", "busy", "lost"]
    assert rules[1].duration == 60
    # a bare list works too; the command line overrides a file rule of the same name
    g = tmp_path / "list.json"
    g.write_text('["busy: utilization>50"]')
    merged = load_rules(["busy: utilization>75"], files=[f, g])
    assert [(r.name, r.limit) for r in merged if r.name == "busy"] == [("busy", 75)]


@pytest.mark.parametrize("content, says", [
    ("{not json", "not valid JSON"),
    ('{"rules": []}', 'expected a "thresholds" list'),
    ('{"thresholds": "temperature>85"}', "must be a list"),
    ('{"thresholds": ["temperature>85", "temp>>1"]}', "rule 2"),
    ('{"thresholds": [{"rule": "lost", "level": "warn"}]}', "unknown key(s) level"),
    ('{"thresholds": [{"name": "x"}]}', '"rule" must be a string'),
    ('{"thresholds": [42]}', "must be a string or an object"),
    ('{"thresholds": [{"name": "two words", "rule": "lost"}]}', '"name" must be a word'),
])
def test_bad_config_files(tmp_path, content, says):
    f = tmp_path / "rules.json"
    f.write_text(content)
    with pytest.raises(ConfigError) as err:
        load_rules_file(f)
    assert says in str(err.value) and str(f) in str(err.value) and "\n" not in str(err.value)


def test_rule_specs_keep_names_and_round_trip(tmp_path):
    from gpusd.thresholds import rule_specs

    f = tmp_path / "rules.json"
    f.write_text('[{"name": "busy", "rule": "util>90 for 1m"}]')
    specs = rule_specs(["temperature>85", "hot: temp above 90"], files=[f])
    assert specs == ["busy: utilization>90% for 60s", "temperature>85C", "hot: temperature>90C"]
    assert [parse_rule(s).name for s in specs] == ["busy", "temperature>85C", "hot"]


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read threshold file"):
        load_rules_file(tmp_path / "nope.json")


def test_instant_rule_exceeds_and_clears_once():
    eng = ThresholdEngine([parse_rule("temperature>85")])
    assert eng.update(host(0, gpu(temperature=80))) == []
    ev = eng.update(host(1, gpu(temperature=87)))
    assert [(e.state, e.gpu, e.value, e.rule.name) for e in ev] == [("exceeded", "GPU-0", 87, "temperature>85C")]
    assert "87 C > 85 C" in ev[0].message and "node-a GPU 0" in ev[0].message
    assert eng.update(host(2, gpu(temperature=90))) == []  # still hot: no repeat
    assert [e.rule.name for e in eng.active()] == ["temperature>85C"]
    ev = eng.update(host(3, gpu(temperature=85)))  # not above 85 any more
    assert [(e.state, e.value, e.since) for e in ev] == [("cleared", 85, 1)]
    assert eng.active() == []


def test_duration_rule_needs_the_condition_to_hold_throughout():
    eng = ThresholdEngine([parse_rule("utilization>90 for 60s")])
    assert eng.update(host(0, gpu(utilization_gpu=95))) == []
    assert eng.update(host(30, gpu(utilization_gpu=96))) == []
    assert eng.update(host(45, gpu(utilization_gpu=50))) == []  # a dip restarts the clock
    assert eng.update(host(50, gpu(utilization_gpu=99))) == []
    assert eng.update(host(109, gpu(utilization_gpu=99))) == []
    ev = eng.update(host(110, gpu(utilization_gpu=99)))
    assert [(e.state, e.since, e.ts) for e in ev] == [("exceeded", 50, 110)]
    ev = eng.update(host(111, gpu(utilization_gpu=10)))
    assert [e.state for e in ev] == ["cleared"]


def test_each_gpu_has_its_own_state():
    eng = ThresholdEngine([parse_rule("memory>95%")])
    ev = eng.update(host(0, gpu(0, memory_used=79 * GiB), gpu(1, memory_used=10 * GiB)))
    assert [(e.gpu, e.index) for e in ev] == [("GPU-0", 0)]
    assert round(ev[0].value, 2) == 98.75


def test_memory_in_bytes_and_power_ratio():
    eng = ThresholdEngine([parse_rule("memory>70GiB"), parse_rule("power>90%")])
    ev = eng.update(host(0, gpu(memory_used=71 * GiB, power_draw=380.0)))
    assert sorted(e.rule.metric for e in ev) == ["memory", "power"]


def test_lost_gpu_unhealthy_then_vanished_then_back():
    eng = ThresholdEngine([parse_rule("lost"), parse_rule("temperature>85")])
    assert [e.state for e in eng.update(host(0, gpu(0, temperature=90), gpu(1)))] == ["exceeded"]  # temperature
    ev = eng.update(host(1, gpu(0, healthy=False, error="GPU is lost", temperature=None), gpu(1)))
    # the temperature reading is gone, not cool: its alert stays; "lost" fires
    assert [(e.state, e.rule.name) for e in ev] == [("exceeded", "lost")]
    ev = eng.update(host(2, gpu(1)))  # GPU 0 vanished from the host altogether
    assert [(e.state, e.rule.name, e.gpu) for e in ev] == [("cleared", "temperature>85C", "GPU-0")]
    assert [e.rule.name for e in eng.active()] == ["lost"]
    ev = eng.update(host(3, gpu(0), gpu(1)))
    assert [(e.state, e.rule.name) for e in ev] == [("cleared", "lost")]


def test_vanished_gpu_trips_lost():
    eng = ThresholdEngine([parse_rule("lost")])
    eng.update(host(0, gpu(0), gpu(1)))
    ev = eng.update(host(1, gpu(0)))
    assert [(e.state, e.gpu, e.index) for e in ev] == [("exceeded", "GPU-1", 1)]
    assert "lost" in ev[0].message


def test_unsupported_reading_does_not_fire():
    eng = ThresholdEngine([parse_rule("fan>80")])
    assert eng.update(host(0, gpu(fan_speed=None))) == []


def test_event_data_matches_the_wire_format():
    eng = ThresholdEngine([parse_rule("hot: temperature>85")])
    d = eng.update(host(5, gpu(temperature=90)))[0].to_dict()
    assert {"state", "rule", "gpu", "value", "ts"} <= set(d)
    assert (d["state"], d["rule"], d["gpu"], d["value"], d["ts"]) == ("exceeded", "hot", "GPU-0", 90, 5)
    assert d["hostname"] == "node-a" and d["node_id"] == "a" * 16
    json.dumps(d)
