"""A LAN stranger for the trust tests: run inside a network namespace of tests/netns.py.

    python stranger.py serve IP LOG [--loopback-record]
        announce a fake ``_gpusd._tcp`` host (hostname ``evil``) at IP:4780, answer its event stream
        with a snapshot whose processes belong to "mallory", and record every request (method, path,
        headers) as one JSON line in LOG.  With ``--loopback-record``, also announce a second host
        whose only address is 127.0.0.1 and whose TXT names a chosen API path (finding 2).
    python stranger.py canary PORT LOG
        listen on 127.0.0.1:PORT and record every request (nobody should ever come).

Prints ``ready`` once serving (and announced).  Stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time

from aiohttp import web

EVIL_NODE = "e71100000000beef"
LOOP_NODE = "100b100b100b100b"


def recorder(log_path: str):  # an aiohttp handler factory
    async def record(request: web.Request) -> web.StreamResponse:
        with open(log_path, "a") as f:  # noqa: ASYNC230 - one short line, a test fixture
            f.write(json.dumps({"method": request.method, "path": request.path_qs, "remote": request.remote,
                                "headers": [[k, v] for k, v in request.headers.items()]}) + "\n")
        if request.path.endswith("/events"):
            return await events(request)
        if request.path == "/healthz":  # what a static peer is asked first (its public reads)
            return web.json_response({"ok": True, "node_id": EVIL_NODE})
        if request.path == "/api/v1/host":
            return web.json_response({"api": 1, "session": "default", "node_id": EVIL_NODE, "hostname": "evil",
                                      "snapshot": json.loads(fake_snapshot())})
        return web.json_response({"error": "nothing here"}, status=404)

    return record


def fake_snapshot() -> str:
    from gpusd.inventory.simulated import SimulatedBackend
    from gpusd.model import ProcessInfo

    snap = SimulatedBackend("2xA100-80GB", host="evil", node=EVIL_NODE).snapshot()
    snap.hostname, snap.node_id = "evil", EVIL_NODE
    snap.gpus[0].processes = [ProcessInfo(pid=666, used_memory=2**30, user="mallory", command="mallory-lies")]
    return snap.to_json()


async def events(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(f"event: snapshot\ndata: {fake_snapshot()}\n\n".encode())
    try:
        while True:
            await asyncio.sleep(1.0)
            await resp.write(f'event: heartbeat\ndata: {{"ts": {time.time()}}}\n\n'.encode())
    except (ConnectionError, RuntimeError):
        pass
    return resp


async def serve(ip: str, log_path: str, loopback_record: bool) -> None:
    from zeroconf import ServiceInfo

    from gpusd.wire.mdns import open_zeroconf
    from gpusd.wire.txt import SERVICE_TYPE, encode_txt

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", recorder(log_path))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, ip, 4780).start()
    zc = await open_zeroconf([ip])
    infos = []
    txt = encode_txt(node_id=EVIL_NODE, hostname="evil", session="default", inventory=[("A100-SXM4-80GB", 81920)] * 2,
                     free=2, gpusd_version="0.1.0")
    infos.append(ServiceInfo(SERVICE_TYPE, f"evil-e7110000.{SERVICE_TYPE}", port=4780, properties=txt,
                             server="evil-e7110000.local.", parsed_addresses=[ip]))
    if loopback_record:
        txt = encode_txt(node_id=LOOP_NODE, hostname="loop", session="default", inventory=[("A100-SXM4-80GB", 81920)],
                         free=1, api="/steal/api/v1")
        infos.append(ServiceInfo(SERVICE_TYPE, f"loop-100b100b.{SERVICE_TYPE}", port=4780, properties=txt,
                                 server="loop-100b100b.local.", parsed_addresses=["127.0.0.1"]))
    for info in infos:
        await (await zc.async_register_service(info))
    print("ready", flush=True)
    await wait_for_term()
    for info in infos:
        await (await zc.async_unregister_service(info))
    await zc.async_close()
    await runner.cleanup()


async def canary(port: int, log_path: str) -> None:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", recorder(log_path))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await wait_for_term()
    await runner.cleanup()


async def wait_for_term() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        asyncio.run(serve(argv[1], argv[2], "--loopback-record" in argv))
    elif argv[:1] == ["canary"]:
        asyncio.run(canary(int(argv[1]), argv[2]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
