"""The TXT schema: compact encoding, and validated decoding of hostile records (no network)."""

from __future__ import annotations

import pytest

from gpusd.model import GpuInfo, HostSnapshot, LeaseInfo, ProcessInfo
from gpusd.wire.sse import SSEError, SSEParser, format_event
from gpusd.wire.txt import (
    MAX_RECORD,
    TxtError,
    count_free,
    decode_hwsd,
    decode_txt,
    encode_hwsd,
    encode_txt,
    instance_name,
    inventory_of,
    record_size,
    short_model,
)

GiB = 2**30


def raw(props: dict[str, str | None] | list[str | bytes]) -> bytes:
    """TXT RDATA from properties (or from raw strings, for hostile records)."""
    items: list[bytes] = []
    if isinstance(props, dict):
        for k, v in props.items():
            items.append(k.encode() if v is None else f"{k}={v}".encode())
    else:
        items = [p.encode() if isinstance(p, str) else p for p in props]
    out = b""
    for it in items:
        assert len(it) <= 255
        out += bytes([len(it)]) + it
    return out


def snap(n: int = 8, name: str = "NVIDIA A100-SXM4-80GB", mem: int = 80 * GiB, util: float = 0.0) -> HostSnapshot:
    gpus = [GpuInfo(index=i, uuid=f"GPU-{i}", name=name, memory_total=mem, memory_used=0, utilization_gpu=util)
            for i in range(n)]
    return HostSnapshot(hostname="gpu-node-3", node_id="7b676f27867c74e8", timestamp=1.0, gpus=gpus)


def encode(s: HostSnapshot, **kw: object) -> dict[str, str]:
    args: dict[str, object] = dict(node_id=s.node_id, hostname=s.hostname, session="default",
                                   inventory=inventory_of(s), free=count_free(s), gpusd_version="0.1.0")
    args.update(kw)
    return encode_txt(**args)  # type: ignore[arg-type]


def test_eight_gpus_compact_and_round_trip() -> None:
    props = encode(snap(8))
    assert props["g0"] == "8*A100-SXM4-80GB;81920"
    assert record_size(props) < 400
    rec = decode_txt(raw(props))
    assert rec.count == 8 and rec.free == 8 and rec.node_id == "7b676f27867c74e8"
    assert rec.hostname == "gpu-node-3" and rec.session == "default" and rec.api == "/api/v1"
    assert rec.inventory == [("A100-SXM4-80GB", 81920)] * 8


def test_heterogeneous_gpus_stay_under_limits() -> None:
    s = snap(8)
    for i, g in enumerate(s.gpus):  # worst case: every GPU different, long names
        g.name = f"NVIDIA Some Very Long Product Name Number {i} With Extra Words"
        g.memory_total = (i + 1) * GiB
    props = encode(s)
    assert record_size(props) <= MAX_RECORD
    assert all(len(f"{k}={v}".encode()) <= 255 for k, v in props.items())
    rec = decode_txt(raw(props))
    assert len(rec.inventory) == 8 and rec.inventory[3][1] == 4096


def test_oversized_inventory_is_dropped_not_truncated() -> None:
    s = snap(64)
    for i, g in enumerate(s.gpus):
        g.name = f"NVIDIA Model {i:02d} " + "x" * 30
    props = encode(s)
    assert record_size(props) <= MAX_RECORD
    assert not any(k.startswith("g") and k[1:].isdigit() for k in props)  # no partial (lying) list
    rec = decode_txt(raw(props))
    assert rec.count == 64 and rec.inventory == []


def test_long_hostname_is_clipped_to_one_string() -> None:
    props = encode(snap(1), hostname="h" * 400)
    assert len(("host=" + props["host"]).encode()) <= 255
    decode_txt(raw(props))


def test_free_counts_leases_processes_and_load() -> None:
    s = snap(4)
    s.gpus[0].utilization_gpu = 50.0
    s.gpus[1].processes.append(ProcessInfo(pid=1))
    s.gpus[2].leases.append(LeaseInfo(lease_id="x", pid=1))
    assert count_free(s) == 1
    s.gpus[3].healthy = False
    assert count_free(s) == 0


def test_flags() -> None:
    rec = decode_txt(raw(encode(snap(1), simulated=True, auth=True)))
    assert rec.simulated and rec.auth


def test_short_model() -> None:
    assert short_model("NVIDIA H100 80GB HBM3") == "H100 80GB HBM3"
    assert short_model("a;b*c=d") == "a b c d"
    assert short_model(None) == "unknown"
    assert len(short_model("x" * 500)) == 48


def test_instance_name() -> None:
    assert instance_name("gpu-node-3.example.com", "7b676f27867c74e8") == "gpu-node-3-7b676f27"
    name = instance_name("a" * 100, "7b676f27867c74e8")
    assert len(name.encode()) <= 63 and name.endswith("-7b676f27")
    assert instance_name("weird_host name", "ab") == "weird-host-name-ab"


GOOD = {"v": "1", "id": "7b676f27867c74e8", "host": "h", "session": "default", "n": "2", "free": "1",
        "g0": "2*A100;81920"}


@pytest.mark.parametrize("change, message", [
    ({"v": "2"}, "version"),
    ({"v": None}, "missing"),
    ({"v": "x"}, "version"),
    ({"id": "../../etc"}, "node id"),
    ({"id": ""}, "node id"),
    ({"n": "3"}, "n=3"),  # the count disagrees with the list: a lie
    ({"n": "1"}, "more GPUs"),
    ({"n": "-1"}, "not a number"),
    ({"n": "99999"}, "out of range"),
    ({"n": "abc"}, "not a number"),
    ({"n": "\u00b2"}, "not a number"),  # str.isdigit() says yes, int() says no: still a TxtError
    ({"free": "\u00b9"}, "not a number"),
    ({"free": "3"}, "free"),
    ({"g0": "garbage"}, "inventory"),
    ({"g2": "1*A100;1"}, "contiguous"),
    ({"session": "bad session!"}, "session"),
    ({"api": "http://evil"}, "API"),
    ({"host": ""}, "host"),
])
def test_hostile_records_are_rejected(change: dict[str, str | None], message: str) -> None:
    props: dict[str, str | None] = dict(GOOD)
    for k, v in change.items():
        if v is None:
            props.pop(k)
        else:
            props[k] = v
    with pytest.raises(TxtError, match=message):
        decode_txt(raw(props))


def test_missing_keys() -> None:
    for key in ("id", "host", "n"):
        props = {k: v for k, v in GOOD.items() if k != key}
        with pytest.raises(TxtError):
            decode_txt(raw(props))


def test_malformed_bytes() -> None:
    good = raw(GOOD)
    with pytest.raises(TxtError, match="past the end"):
        decode_txt(good + b"\x40abc")
    with pytest.raises(TxtError, match="exceeds"):
        decode_txt(good + raw(["x" * 200] * 7))
    with pytest.raises(TxtError, match="UTF-8"):
        decode_txt(raw([*(f"{k}={v}" for k, v in GOOD.items() if k != "host"), b"host=\xff\xfe"]))
    with pytest.raises(TxtError, match="control"):
        decode_txt(raw([*(f"{k}={v}" for k, v in GOOD.items() if k != "host"), "host=a\x07b"]))
    with pytest.raises(TxtError, match="empty key"):
        decode_txt(good + raw(["=x"]))
    with pytest.raises(TxtError):
        decode_txt(b"")
    with pytest.raises(TxtError):
        decode_txt("not bytes")  # type: ignore[arg-type]


def test_rfc6763_rules() -> None:
    # keys are case-insensitive, the first of duplicates wins, unknown keys are ignored
    rec = decode_txt(raw(["V=1", "ID=7b676f27867c74e8", "host=first", "host=second", "n=0", "future=1", "flag"]))
    assert rec.hostname == "first" and rec.count == 0


def test_mapping_input_matches_bytes() -> None:
    props = {k.encode(): v.encode() for k, v in GOOD.items()}
    assert decode_txt(props).node_id == decode_txt(raw(GOOD)).node_id
    with pytest.raises(TxtError, match="255"):
        decode_txt({**props, b"x": b"y" * 300})


def test_hwsd_round_trip_and_nul_bytes() -> None:
    props = encode_hwsd(node_id="abc", hostname="render-1", session="default", count=2)
    rec = decode_hwsd(raw(props))
    assert rec.source == "hwsd" and rec.count == 2 and rec.gpusd_marker
    assert rec.hwsd_gpus == [("GLX", 0, 0), ("GLX", 0, 1)]
    # hwsd itself: four-character codes padded with NUL bytes, no gpusd marker
    hw = raw([b"Session=default", b"NodeID=0123-4567", b"Hostname=viz", b"GPU Count=2",
              b"GPU0 Type=GLX\x00", b"GPU0 Port=0", b"GPU0 Device=0", b"GPU1 Type=GLX\x00",
              b"GPU1 Port=0", b"GPU1 Device=1", b"GPU0 Width=1920"])
    rec = decode_hwsd(hw)
    assert not rec.gpusd_marker and rec.inventory[1][0] == "GLX :0.1" and rec.hostname == "viz"


# What hwsd's reader (hwsd/gpu/dns_sd/module.cpp, values read with ``istringstream >>``) makes of
# records: each case is (TXT strings, GPUs hwsd lists as (type, port, device)); None: not announced.
U = 2**32 - 1


@pytest.mark.parametrize("items, gpus", [
    # a GPU without Type is skipped, the others are kept
    ([b"GPU Count=3", b"GPU0 Type=GLX", b"GPU2 Type=GLX", b"GPU2 Port=1"], [("GLX", U, U), ("GLX", 1, U)]),
    # an empty Type is no Type
    ([b"GPU Count=2", b"GPU0 Type=", b"GPU1 Type=CGL"], [("CGL", U, U)]),
    # no GPU Count: 0 GPUs, the GPU keys are not read
    ([b"Session=default", b"GPU0 Type=GLX"], []),
    # a count that is not a number reads as 0
    ([b"GPU Count=x", b"GPU0 Type=GLX"], []),
    (["GPU Count=\u00b2".encode(), b"GPU0 Type=GLX"], []),
    # GPU keys beyond the count are ignored
    ([b"GPU Count=1", b"GPU0 Type=GLX", b"GPU5 Type=GLX"], [("GLX", U, U)]),
    # 10-digit numbers, trailing text, white space, a sign (unsigned arithmetic), overflow
    ([b"GPU Count=1", b"GPU0 Type=GLX", b"GPU0 Port=4294967295", b"GPU0 Device=1234567890"], [("GLX", U, 1234567890)]),
    ([b"GPU Count= 2 GPUs", b"GPU0 Type=WGLn", b"GPU0 Port=12abc", b"GPU1 Type=WGLa", b"GPU1 Device=+7"],
     [("WGLn", 12, U), ("WGLa", U, 7)]),
    ([b"GPU Count=1", b"GPU0 Type=GLX", b"GPU0 Port=-3", b"GPU0 Device=99999999999"], [("GLX", 2**32 - 3, U)]),
    ([b"GPU Count=0000000000001", b"GPU0 Type=GLX", b"GPU1 Type=GLX"], [("GLX", U, U)]),  # 13 digits, value 1
    # a huge count is not a reason to refuse: only the GPUs announced are listed
    ([b"GPU Count=4294967295", b"GPU0 Type=GLX", b"GPU1 Type=GLX"], [("GLX", U, U), ("GLX", U, U)]),
    # types: the first word, NUL-terminated four-character codes, longer ones cut to four characters
    ([b"GPU Count=2", b"GPU0 Type=GLX\x00", b"GPU1 Type=GLXYZ extra"], [("GLX", U, U), ("GLXY", U, U)]),
    # hwsd writes GPU<k> with k in decimal: GPU01 is not GPU1
    ([b"GPU Count=2", b"GPU01 Type=GLX", b"GPU1 Type=CGL"], [("CGL", U, U)]),
    # strings hwsd ignores (no key, binary key) do not cost the record
    ([b"=x", b"\xff\xfe=1", b"GPU Count=1", b"GPU0 Type=GLX"], [("GLX", U, U)]),
])
def test_hwsd_decoding_is_as_lenient_as_hwsd(items: list[bytes], gpus: list[tuple[str, int, int]]) -> None:
    rec = decode_hwsd(raw(items))
    assert rec.hwsd_gpus == gpus
    assert rec.count == len(gpus) == len(rec.inventory)


def test_hwsd_text_values_are_first_words_made_printable() -> None:
    rec = decode_hwsd(raw([b"Session=viz lab", b"Hostname=render\x07-1 x", b"NodeID=not/an/id", b"GPU Count=1",
                           "GPU0 Type=G\u00e9\u0000".encode(), b"GPU0 Port=0", b"GPU0 Device=1"]))
    assert rec.session == "viz" and rec.hostname == "render?-1"
    assert rec.node_id == ""  # unusable: the client names the host by its instance name
    assert rec.hwsd_gpus == [("G\u00e9", 0, 1)] and rec.inventory[0][0] == "G\u00e9 :0.1"
    rec = decode_hwsd(raw([b"Hostname=" + "\u202eevil".encode(), b"GPU Count=0"]))
    assert rec.hostname == "?evil"  # no bidirectional override reaches a terminal


def test_hwsd_bounds_against_hostile_records() -> None:
    with pytest.raises(TxtError, match="256 GPUs"):  # hwsd would list them all; we stop at 256
        decode_hwsd(raw([b"GPU Count=1000"] + [f"GPU{i} Type=GLX".encode() for i in range(300)]))
    with pytest.raises(TxtError, match="exceeds"):
        decode_hwsd(raw([b"GPU Count=1"] + [b"X" * 250] * 40))
    with pytest.raises(TxtError, match="past the end"):
        decode_hwsd(raw([b"GPU Count=1"]) + b"\x40abc")
    with pytest.raises(TxtError):
        decode_hwsd("not bytes")  # type: ignore[arg-type]
    # a long run of digits is an overflow, read in bounded time
    assert decode_hwsd(raw([b"GPU Count=2", b"GPU0 Type=GLX", b"GPU0 Port=" + b"9" * 240])).hwsd_gpus == [("GLX", U, U)]


def test_sse_parser() -> None:
    p = SSEParser(max_event=1000)
    data = format_event("snapshot", {"a": 1}) + b": comment\n\nevent: heartbeat\r\ndata: {}\r\n\r\n"
    events = []
    for i in range(len(data)):  # byte by byte: framing is independent of chunking
        events.extend(p.feed(data[i:i + 1]))
    assert events == [("snapshot", '{"a":1}'), ("heartbeat", "{}")]
    with pytest.raises(SSEError):
        list(SSEParser(max_event=100).feed(b"data: " + b"x" * 200))
    with pytest.raises(SSEError):
        list(SSEParser(max_event=100).feed(b"data: " + b"x" * 60 + b"\ndata: " + b"y" * 60 + b"\n"))
    with pytest.raises(SSEError):
        list(SSEParser().feed(b"data: \xff\n"))
