"""Which fields of the wire format are private, and how they are withheld.

Process owners and commands (``user``, ``command`` in every entry of a ``processes`` or ``leases``
list) are private: the daemon serves them only to readers it trusts (docs/security.md), and a client
drops them from hosts that did not prove they hold the fleet secret.  Both sides use :func:`redact`.
"""

from __future__ import annotations

from typing import Any

PRIVATE_FIELDS = ("user", "command")
_PRIVATE_LISTS = ("processes", "leases")


def redact(payload: Any) -> Any:
    """A copy of a JSON-like payload (snapshot, GPU list, fleet, event data) where every entry of a
    ``processes`` or ``leases`` list has ``user`` and ``command`` set to ``None``.  Other values are
    shared, not copied."""
    if isinstance(payload, dict):
        out = {}
        for k, v in payload.items():
            if k in _PRIVATE_LISTS and isinstance(v, list):
                out[k] = [_strip(e) for e in v]
            else:
                out[k] = redact(v)
        return out
    if isinstance(payload, list):
        return [redact(v) for v in payload]
    return payload


def _strip(entry: Any) -> Any:
    if not isinstance(entry, dict):
        return entry
    return {k: (None if k in PRIVATE_FIELDS else v) for k, v in entry.items()}
