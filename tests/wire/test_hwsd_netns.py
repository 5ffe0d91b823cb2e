"""A ``--gpusd-compat`` daemon seen from another host of a namespace LAN (tests/netns.py), the way
GPU-SD/hwsd and Equalizer see it: both of hwsd's records, read with hwsd's key names, make one
Equalizer render node connected to the daemon's address.  Nothing leaves the namespaces."""

from __future__ import annotations

import json
import sys
import textwrap

from fakenvml import make_gpus
from gpusd.wire.txt import decode_hwsd, decode_hwsd_net
from hwsd_reader import equalizer_nodes, read_gpu_record, read_net_record, txt_strings
from netns import Lan, lan, netns_ok  # noqa: F401

RESOLVE = textwrap.dedent('''
    import json, sys, time
    from zeroconf import ServiceBrowser, Zeroconf

    types = ["_gpu-sd._tcp.local.", "_net-sd._tcp.local."]
    zc = Zeroconf(interfaces=[sys.argv[1]])
    found = {}

    class Listener:
        def add_service(self, zc, type_, name):
            found.setdefault(type_, name)
        update_service = remove_service = lambda *a: None

    browsers = [ServiceBrowser(zc, t, Listener()) for t in types]
    deadline = time.monotonic() + 15
    while len(found) < len(types) and time.monotonic() < deadline:
        time.sleep(0.05)
    for type_, name in found.items():
        info = zc.get_service_info(type_, name, 3000)
        if info is not None:
            print(json.dumps({"type": type_, "name": name, "port": info.port, "server": info.server,
                              "addresses": info.parsed_addresses(), "text": info.text.hex()}), flush=True)
    zc.close()
''')


def test_equalizer_gets_a_render_node_from_a_compat_host(lan: Lan) -> None:
    host = lan.add_gpu_host("render-1", make_gpus(2), fast=True, args=["--gpusd-compat"],
                            extra_env={"DISPLAY": ":2"})
    client = lan.add_node("client")
    host.start()
    r = lan.run(client, [sys.executable, "-c", RESOLVE, client.ip], timeout=60)
    records = {d["type"]: d for d in map(json.loads, r.stdout.splitlines())}
    assert set(records) == {"_gpu-sd._tcp.local.", "_net-sd._tcp.local."}, r.stderr + host.log_tail()
    gpu, net = records["_gpu-sd._tcp.local."], records["_net-sd._tcp.local."]
    assert gpu["port"] == net["port"] == 4242 and gpu["addresses"] == [host.ip]

    # our own decoder
    rec = decode_hwsd(bytes.fromhex(gpu["text"]))
    assert rec.hwsd_gpus == [("GLX", 2, 0), ("GLX", 2, 1)] and rec.hostname == "render-1" and rec.gpusd_marker
    net_rec = decode_hwsd_net(bytes.fromhex(net["text"]))
    assert net_rec.node_id == rec.node_id and [(n.name, n.ipv4, n.type, n.up) for n in net_rec.nets] == [
        ("eth0", host.ip, "ETHERNET", True)]
    assert net_rec.nets[0].mac  # the veth's address, from the namespace's sysfs

    # hwsd's reader and Equalizer's auto-configuration
    instance = gpu["name"].split(".")[0]
    node = read_gpu_record(instance, txt_strings(bytes.fromhex(gpu["text"])))
    [render] = equalizer_nodes([node], read_net_record(txt_strings(bytes.fromhex(net["text"]))))
    assert render.name == "render-1" and render.session == "default" and render.connections == [host.ip]
    assert [(g.type, g.port, g.device) for g in render.gpus] == [("GLX", 2, 0), ("GLX", 2, 1)]
