"""`gpusd export prometheus-sd` (file, --url) and every daemon's /api/v1/prometheus/http_sd are one
document made by one function (issue 18, item 11); `export dns-sd-zone` publishes what a --peer host
really has."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from gpusd.discovery import beyond
from gpusd.discovery.types import RemoteHost
from gpusd.model import GpuInfo, HostSnapshot
from gpusd.views import sd
from gpusd.wire.fleet import FleetView
from gpusd.wire.promsd import daemons_from_hosts, file_sd
from gpusd.wire.txt import decode_txt, encode_txt

GiB = 2**30


def remote(name: str, session: str, address: str, verified: bool | None, via: str = "mdns",
           gpus: int = 2, inventory: bool = True) -> RemoteHost:
    txt = decode_txt(encode_txt(node_id=name[-1] * 16, hostname=name, session=session,
                                inventory=[("A100-SXM4-80GB", 81920)] * gpus if inventory else [],
                                free=gpus if inventory else 0))
    snap = HostSnapshot(hostname=name, node_id=name[-1] * 16, timestamp=time.time(),
                        gpus=[GpuInfo(index=i, uuid=f"GPU-{name}-{i}", name="NVIDIA A100-SXM4-80GB",
                                      memory_total=80 * GiB, memory_used=0, utilization_gpu=0.0)
                              for i in range(gpus)])
    return RemoteHost(key=name, txt=txt, addresses=[address], port=4780, url=f"http://{address}:4780/api/v1",
                      snapshot=snap, alive=True, verified=verified, via=via)


def test_each_host_is_labelled_with_its_own_session_and_how_it_was_found() -> None:
    hosts = [remote("node-a", "default", "198.18.0.1", True), remote("node-b", "lab", "198.18.0.2", True, "peer"),
             remote("node-c", "lab", "198.18.0.3", False)]  # did not prove it holds the secret: left out
    groups = file_sd(daemons_from_hosts(hosts))  # --all-sessions
    meta = [g["labels"] for g in groups]
    assert [(m["__meta_gpusd_hostname"], m["__meta_gpusd_session"], m["__meta_gpusd_verified"],
             m["__meta_gpusd_via"]) for m in meta] == [("node-a", "default", "true", "mdns"),
                                                       ("node-b", "lab", "true", "peer")]
    # every discovery fact is a __meta_ label: Prometheus drops it after relabelling, so none of them
    # (a host becoming verified, found another way) changes a series' identity
    assert all(k.startswith("__") for m in meta for k in m)
    only = file_sd(daemons_from_hosts(hosts, "lab"))
    assert [g["labels"]["__meta_gpusd_hostname"] for g in only] == ["node-b"]


def test_the_file_and_the_daemons_http_sd_are_the_same_document() -> None:
    """What a daemon serves (its fleet view's hosts) and what the CLI writes from the same hosts
    (browsed, or through --url) are equal, labels included."""
    hosts = [remote("node-a", "default", "198.18.0.1", True), remote("node-b", "lab", "198.18.0.2", None, "dns-sd")]
    view = FleetView(session="default", hosts=[h.record() for h in hosts])
    served = file_sd(daemons_from_hosts(view.hosts))  # GET /api/v1/prometheus/http_sd
    via_url = file_sd(daemons_from_hosts(sd.fleet_hosts(json.loads(json.dumps(view.to_dict())))))
    browsed = file_sd(daemons_from_hosts(hosts))
    assert served == via_url == browsed
    assert served[1]["labels"] == {"__meta_gpusd_hostname": "node-b", "__meta_gpusd_node_id": "b" * 16,
                                   "__meta_gpusd_session": "lab", "__meta_gpusd_verified": "unknown",
                                   "__meta_gpusd_via": "dns-sd"}
    # an answering daemon that did not prove it holds the fleet secret vouches for nobody
    assert daemons_from_hosts(sd.fleet_hosts(view.to_dict(), trusted=False)) == []


def test_export_writes_the_labels_of_the_document(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from gpusd.cli import main
    from gpusd.views import sources

    hosts = [remote("node-a", "default", "198.18.0.1", True, "peer")]

    def fake_init(self: Any, *a: Any, **kw: Any) -> None:
        self._settled = True

    monkeypatch.setattr(sources.DiscoverySource, "__init__", fake_init)
    monkeypatch.setattr(sources.DiscoverySource, "remote_hosts", lambda self: hosts)
    monkeypatch.setattr(sources.DiscoverySource, "close", lambda self: None)
    out = tmp_path / "t.json"
    assert main(["export", "prometheus-sd", "-o", str(out), "--browse", "0", "--interface", "127.0.0.1"]) == 0
    labels = json.loads(out.read_text())[0]["labels"]
    assert labels["__meta_gpusd_verified"] == "true" and labels["__meta_gpusd_via"] == "peer"


def test_zone_records_of_a_peer_name_its_gpus() -> None:
    """A --peer host's TXT is made up from its HTTP API and names no inventory: the records use its
    snapshot (n=2 free=2, not n=0 free=0)."""
    peer = remote("node-p", "default", "198.18.2.5", True, "peer", gpus=2, inventory=False)
    lines = beyond.zone_records([peer], "lab.example", 60)
    (txt_line,) = [line for line in lines if " TXT " in line]
    assert " n=0" not in txt_line and "free=0" not in txt_line, txt_line
    assert "n=2" in txt_line and "free=2" in txt_line, txt_line
