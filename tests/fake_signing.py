"""A fake daemon's side of the trust protocol (docs/security.md), for test servers that stand in for
a daemon: check a signed request and sign the answer, as a daemon holding ``secret`` does."""

from __future__ import annotations

from typing import Any

from gpusd.wire.signing import FleetKey, Headers, Request, Response


def proof_headers(request: Any, secret: str, body: bytes, node_id: str) -> dict[str, str]:
    """The proof headers for ``body`` answering the aiohttp ``request``, or {} when the request is
    unsigned or signed with another secret (then a daemon answers unproven)."""
    if "Signature" not in request.headers:
        return {}
    key = FleetKey(secret)
    req = Request(request.method, str(request.url), Headers(request.headers))
    try:
        nonce = key.verify_request(req).nonce
    except Exception:  # noqa: BLE001 - signed with a secret this daemon does not hold
        return {}
    resp = Response(200, req, Headers())
    key.sign_response(resp, nonce, node_id, None, body)
    return dict(resp.headers)
