"""Running slurmd beside the daemon as a dynamic, configless Slurm node (``gpusd start --slurm``,
docs/slurm.md): the slurmd command line from the host's snapshot, the controller's address, and
draining or removing the node when the host goes or a GPU is lost (``scontrol``)."""

from __future__ import annotations

import ipaddress
import re

from ..errors import ConfigError

DEFAULT_PORT = 6817
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,253})$")


def parse_controller(text: str) -> tuple[str, int]:
    """``HOST[:PORT]`` (or a bare ``PORT`` for this host, as ``--slurmctld`` takes it) -> (host, port);
    ConfigError when it is neither a host name nor an address, or the port is out of range."""
    text = text.strip()
    host, port_s = text, ""
    if text.isdigit():
        host, port_s = "", text
    elif text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_s = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port_s = text.split(":")
    port = DEFAULT_PORT
    if port_s:
        if not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise ConfigError(f"bad Slurm controller port in {text[:80]!r}")
        port = int(port_s)
    if host:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not _HOST.match(host):
                raise ConfigError(f"bad Slurm controller {text[:80]!r} (HOST[:PORT])") from None
    return host, port
