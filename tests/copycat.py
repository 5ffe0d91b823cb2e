"""A LAN stranger that copies a real daemon's announcement (issue 17, attack 1): run inside a network
namespace of tests/netns.py.  It holds no fleet secret.

    python copycat.py OWN_IP NAME [NAME ...]
        browse ``_gpusd._tcp`` until a gpusd host is announced, then re-announce its TXT record (node id,
        port, TLS port and certificate fingerprint) and its addresses under one new service name per
        NAME, each with ``host=NAME``: the real daemon answers every proof asked of a copy.

Prints ``ready {"copied": SERVICE, "names": [...]}`` once announced.  Stops on SIGTERM (goodbyes sent).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
from typing import Any

from stranger import wait_for_term


async def find_one(zc: Any, service_type: str, timeout: float = 30.0) -> Any:
    from zeroconf import ServiceStateChange
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo

    found: asyncio.Queue[str] = asyncio.Queue()

    def seen(zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
        if state_change is ServiceStateChange.Added:
            found.put_nowait(name)

    browser = AsyncServiceBrowser(zc.zeroconf, [service_type], handlers=[seen])
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            name = await asyncio.wait_for(found.get(), max(0.1, deadline - loop.time()))
            info = AsyncServiceInfo(service_type, name)
            if await info.async_request(zc.zeroconf, 3000) and info.properties.get(b"id"):
                return info
    finally:
        await browser.async_cancel()


async def copy(own_ip: str, names: list[str]) -> None:
    from zeroconf import IPVersion, ServiceInfo

    from gpusd.wire.mdns import open_zeroconf
    from gpusd.wire.txt import SERVICE_TYPE

    zc = await open_zeroconf([own_ip])
    real = await find_one(zc, SERVICE_TYPE)
    tag = secrets.token_hex(3)
    infos = []
    for i, name in enumerate(names):
        props = dict(real.properties)
        props[b"host"] = name.encode()
        label = f"copy{i}-{tag}"
        infos.append(ServiceInfo(SERVICE_TYPE, f"{label}.{SERVICE_TYPE}", port=real.port, properties=props,
                                 server=f"{label}.local.", parsed_addresses=real.parsed_addresses(IPVersion.V4Only)))
    for info in infos:
        await (await zc.async_register_service(info))
    print("ready " + json.dumps({"copied": real.name, "names": names}), flush=True)
    await wait_for_term()
    for info in infos:
        await (await zc.async_unregister_service(info))
    await zc.async_close()


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    asyncio.run(copy(argv[0], argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
