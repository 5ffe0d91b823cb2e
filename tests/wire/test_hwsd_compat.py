"""``--gpusd-compat``: the records a gpusd host announces for GPU-SD/hwsd clients and Equalizer,
checked against our own hwsd decoder and against what hwsd/Equalizer read (tests/hwsd_reader.py).
The same over real multicast between namespaces is in tests/wire/test_hwsd_netns.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusd.daemon.hwsd import describe, interfaces, x_display
from gpusd.wire.txt import (
    HwsdNet,
    decode_hwsd,
    decode_hwsd_net,
    encode_hwsd,
    encode_hwsd_net,
    hwsd_node_id,
)
from hwsd_reader import (
    equalizer_nodes,
    read_gpu_record,
    read_net_record,
    txt_strings,
    uint128,
)


def rdata(props: dict[str, str]) -> bytes:
    out = b""
    for k, v in props.items():
        item = f"{k}={v}".encode()
        assert len(item) <= 255
        out += bytes([len(item)]) + item
    return out


NODE = "7b676f27867c74e8"
NETS = [HwsdNet(name="eth0", ipv4="198.18.0.2", mac="02:00:00:00:00:02", linkspeed=10000),
        HwsdNet(name="ib0", ipv4="10.1.0.2", type="INFINIBAND"),
        HwsdNet(name="eth1", ipv4="192.0.2.9", up=False)]


def test_gpu_record_round_trip_and_what_hwsd_reads() -> None:
    props = encode_hwsd(node_id=NODE, hostname="gpu-node-3", session="render", count=3, display=1)
    # our decoder
    rec = decode_hwsd(rdata(props))
    assert rec.gpusd_marker and rec.node_id == NODE and rec.hostname == "gpu-node-3" and rec.session == "render"
    assert rec.hwsd_gpus == [("GLX", 1, 0), ("GLX", 1, 1), ("GLX", 1, 2)]
    assert [m for m, _ in rec.inventory] == ["GLX :1.0", "GLX :1.1", "GLX :1.2"]
    # hwsd's reader: exact key names, a window-system type, X display = Port, X screen = Device
    node = read_gpu_record("gpu-node-3-7b676f27", txt_strings(rdata(props)))
    assert node.node_id == (0, int(NODE, 16)) and node.name == "gpu-node-3" and node.session == "render"
    assert [(g.type, g.port, g.device) for g in node.gpus] == [("GLX", 1, 0), ("GLX", 1, 1), ("GLX", 1, 2)]


def test_net_record_round_trip_and_what_equalizer_uses() -> None:
    gpu = encode_hwsd(node_id=NODE, hostname="gpu-node-3", session="default", count=2)
    net = encode_hwsd_net(node_id=NODE, hostname="gpu-node-3", session="default", nets=NETS)
    assert net["Net Count"] == "3" and net["Net0 Up"] == "1" and net["Net2 Up"] == "0"
    assert net["Net0 Linkspeed"] == "10000" and "Net1 Linkspeed" not in net and net["Net1 Type"] == "INFINIBAND"
    rec = decode_hwsd_net(rdata(net))
    assert rec.node_id == NODE and rec.gpusd_marker and rec.nets == NETS
    # Equalizer: one render node for the host, connected over TCP/IP to the Ethernet interface that is up
    [node] = equalizer_nodes([read_gpu_record("x", txt_strings(rdata(gpu)))], read_net_record(txt_strings(rdata(net))))
    assert node.connections == ["198.18.0.2"] and len(node.gpus) == 2
    # without the net record (gpusd 0.1), or with another NodeID, Equalizer drops the host
    assert equalizer_nodes([read_gpu_record("x", txt_strings(rdata(gpu)))], []) == []
    other = encode_hwsd_net(node_id="0123456789abcdef", hostname="gpu-node-3", session="default", nets=NETS)
    assert equalizer_nodes([read_gpu_record("x", txt_strings(rdata(gpu)))],
                           read_net_record(txt_strings(rdata(other)))) == []


def test_long_node_ids_are_lunchbox_uint128() -> None:
    long_id = "0123456789abcdef" * 4
    assert hwsd_node_id(NODE) == NODE
    assert uint128(hwsd_node_id(long_id)) == (0x0123456789ABCDEF, 0x0123456789ABCDEF)
    props = encode_hwsd(node_id=long_id, hostname="h", session="default", count=1)
    assert decode_hwsd(rdata(props)).node_id == "0123456789abcdef:0123456789abcdef"


def test_records_stay_within_txt_limits() -> None:
    long_host = "h" * 400
    props = encode_hwsd(node_id=NODE, hostname=long_host, session="default", count=128)
    assert all(len(f"{k}={v}".encode()) <= 255 for k, v in props.items())
    assert len(decode_hwsd(rdata(props)).hwsd_gpus) == 128
    many = [HwsdNet(name=f"eth{i}", ipv4=f"10.0.{i}.1") for i in range(40)]
    net = encode_hwsd_net(node_id=NODE, hostname=long_host, session="default", nets=many)
    assert net["Net Count"] == "32" and len(decode_hwsd_net(rdata(net)).nets) == 32


def test_hostile_net_records() -> None:
    rec = decode_hwsd_net(rdata({"Net Count": "4294967295", "Net0 Type": "ETHERNET", "Net0 IPv4": "10.0.0.1",
                                 "Net0 Up": "7", "Net1 Type": "WIFI\u202e", "NodeID": "../x"}))
    assert len(rec.nets) == 32  # bounded, whatever the count says
    assert rec.nets[0].up and rec.nets[0].type == "ETHERNET" and rec.nets[1].type == "UNKNOWN"
    assert rec.node_id == ""
    assert decode_hwsd_net(rdata({"Session": "x"})).nets == []  # no count: no interfaces, as in hwsd


@pytest.mark.parametrize("display, port", [
    (None, 0), (":0", 0), (":1", 1), (":1.0", 1), ("unix:2.1", 2), ("localhost:10.0", 0), ("garbage", 0),
    (":99999999", 0),
])
def test_x_display(display: str | None, port: int) -> None:
    assert x_display({} if display is None else {"DISPLAY": display}) == port


def test_interfaces_from_sysfs(tmp_path: Path) -> None:
    def iface(name: str, type_: int, flags: str, speed: str | None, mac: str) -> None:
        d = tmp_path / name
        d.mkdir()
        (d / "type").write_text(f"{type_}\n")
        (d / "flags").write_text(flags + "\n")
        (d / "address").write_text(mac + "\n")
        if speed is not None:
            (d / "speed").write_text(speed + "\n")

    iface("eth0", 1, "0x1003", "25000", "02:00:00:00:00:01")
    iface("ib0", 32, "0x1003", None, "80:00:02:08:fe:80:00:00:00:00:00:00:00:02:c9:03:00:0a:0b:0c")
    iface("wg0", 65534, "0x1002", "-1", "")  # down, no ARP type hwsd knows, speed unknown
    assert describe("eth0", "10.0.0.2", tmp_path) == HwsdNet("eth0", "10.0.0.2", "ETHERNET",
                                                             "02:00:00:00:00:01", True, 25000)
    ib = describe("ib0", "10.1.0.2", tmp_path)
    assert ib.type == "INFINIBAND" and ib.mac is not None and ib.linkspeed is None
    assert describe("wg0", "10.2.0.2", tmp_path) == HwsdNet("wg0", "10.2.0.2", "UNKNOWN", None, False, None)
    # loopback is never announced (hwsd drops it; Equalizer would not use it)
    assert interfaces(["127.0.0.1"], tmp_path) == []
