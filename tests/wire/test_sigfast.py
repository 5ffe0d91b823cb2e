"""The fast path of gpusd's own signature shape (gpusd.wire.sigfast) against the library, the reference:
what one signs the other verifies, the fast verifier accepts only what the library accepts (with the
same result), and mutated, stale or foreign-shaped signatures are refused as before."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusd.wire import sigfast
from gpusd.wire.signing import MAX_SKEW, TAG_REQUEST, TAG_RESPONSE, FleetKey, Headers, Request, Response

KEY = FleetKey("differential-test-secret-0123456789")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

methods = st.sampled_from(["GET", "POST", "DELETE", "PUT", "HEAD", "OPTIONS"])
hosts = st.sampled_from(["127.0.0.1:7390", "gpu-01.lan:7390", "[::1]:7390", "Host.Example:80", "h:443", "node"])
seg = st.text(alphabet="abcxyz09-._~%2F", min_size=0, max_size=8)
paths = st.lists(seg, min_size=0, max_size=4).map(lambda p: "/" + "/".join(p))
queries = st.one_of(st.just(""), st.text(alphabet="abz09=&+,", min_size=0, max_size=12).map(lambda q: "?" + q))
nodes = st.one_of(st.none(), st.text(alphabet="abcdef0123456789-", min_size=1, max_size=20))
bodies = st.binary(max_size=64)


def library_verify(req: Request, body: bytes) -> Any:
    """The library path of FleetKey.verify_request, without the fast path."""
    results = KEY._req_verifier.verify(req, max_age=datetime.timedelta(0), expect_tag=TAG_REQUEST, body=body)
    assert len(results) == 1 and results[0].nonce
    return results[0]


def library_sign(method: str, url: str, node: str | None, body: bytes, nonce: str, created: int) -> dict[str, str]:
    from gpusd.wire.signing import LABEL, _apply

    req = Request(method, url, Headers())
    covered = ["@method", "@authority", "@path", "@query"]
    if node:
        req.headers["Gpusd-Node"] = node
        covered.append("gpusd-node")
    prepared = KEY._req_signer.prepare(req, key_id=KEY.key_id, nonce=nonce, label=LABEL, tag=TAG_REQUEST,
                                       created=datetime.datetime.fromtimestamp(created, datetime.timezone.utc),
                                       covered_component_ids=covered, body=body)
    _apply(req.headers, prepared.signature_params, KEY.request_key, prepared.signature_base)
    return dict(req.headers)


def fast_verify(req: Request, body: bytes) -> Any:
    return sigfast.verify_request(KEY.request_key, KEY.key_id, req.method, req.url, req.headers, body, MAX_SKEW)


def library_result(req: Request, body: bytes) -> Any:
    try:
        return library_verify(req, body)
    except Exception:  # noqa: BLE001
        return None


@SETTINGS
@given(methods, hosts, paths, queries, nodes, bodies, st.text(alphabet="abcXYZ09_-", min_size=1, max_size=30))
def test_fast_signer_matches_library_signer(method: str, host: str, path: str, query: str, node: str | None,
                                            body: bytes, nonce: str) -> None:
    url = f"http://{host}{path}{query}"
    created = int(time.time())
    fast = sigfast.sign_request(KEY.request_key, KEY.key_id, method, url, node, body, nonce, created)
    try:
        lib = library_sign(method, url, node, body, nonce, created)
    except Exception:  # noqa: BLE001 - a URL the library refuses: the fast signer declines it too
        assert fast is None
        return
    assert fast is not None
    assert fast[0] == lib  # the same headers, byte for byte
    req = Request(method, url, Headers(fast[0]))
    result = library_verify(req, body)  # the library accepts the fast signer's signature
    assert fast[1] == "\n".join(f"{k}: {v}" for k, v in result.covered_components.items()).encode()  # same base
    assert fast_verify(req, body) == result  # and the fast verifier gives the library's result


@SETTINGS
@given(methods, hosts, paths, queries, nodes, bodies)
def test_fast_verifier_accepts_library_signatures(method: str, host: str, path: str, query: str,
                                                  node: str | None, body: bytes) -> None:
    url = f"http://{host}{path}{query}"
    try:
        headers, _ = KEY.sign_request(method, url, node_id=node, body=body)
    except Exception:  # noqa: BLE001 - a URL the library refuses
        assert sigfast.sign_request(KEY.request_key, KEY.key_id, method, url, node, body, "n", 1) is None
        return
    req = Request(method, url, Headers(headers))
    assert fast_verify(req, body) == library_verify(req, body)


def _mutations(h: dict[str, str]) -> list[tuple[str, dict[str, str], bytes | None, str | None]]:
    si, sig = h["Signature-Input"], h["Signature"]
    out: list[tuple[str, dict[str, str], bytes | None, str | None]] = []

    def m(name: str, url: str | None = None, body: bytes | None = None, **changes: str | None) -> None:
        new = dict(h)
        for k, v in changes.items():
            k = k.replace("_", "-")
            if v is None:
                new.pop(k, None)
            else:
                new[k] = v
        out.append((name, new, body, url))

    m("node header changed", Gpusd_Node="other")
    m("digest changed", Content_Digest="sha-256=:" + "A" * 43 + "=:")
    m("body changed", body=b"x")
    m("authority changed", url="http://evil:7390/api/v1/gpus")
    m("path changed", url="http://h:7390/api/v1/leases")
    m("query changed", url="http://h:7390/api/v1/gpus?x=1")
    m("nonce changed", Signature_Input=si.replace('nonce="', 'nonce="x'))
    m("created changed", Signature_Input=si.replace(";created=", ";created=1"))
    m("created leading zero", Signature_Input=si.replace(";created=", ";created=0"))
    m("keyid changed", Signature_Input=si.replace('keyid="gpusd-', 'keyid="gpusd-0'))
    m("alg changed", Signature_Input=si.replace("hmac-sha256", "rsa-pss-sha512"))
    m("tag changed", Signature_Input=si.replace("gpusd-request", "gpusd-response"))
    m("components reordered", Signature_Input=si.replace('"@method" "@authority"', '"@authority" "@method"'))
    m("component dropped", Signature_Input=si.replace(' "@query"', ""))
    m("component duplicated", Signature_Input=si.replace('"@path"', '"@path" "@path"'))
    m("params reordered", Signature_Input=si.replace(';alg="hmac-sha256"', "") + ';alg="hmac-sha256"')
    m("expires added", Signature_Input=si + ";expires=1")
    m("label duplicated", Signature_Input=si + ", " + si)
    m("second label", Signature_Input=si + ", other=" + si[6:], Signature=sig + ", other=" + sig[6:])
    m("other label", Signature_Input="other=" + si[6:], Signature="other=" + sig[6:])
    m("whitespace", Signature_Input=si.replace('"@method" ', '"@method"  '))
    m("outer whitespace", Signature_Input="  " + si + " ", Signature=" " + sig)
    m("bad base64", Signature=sig[:10] + "!" + sig[11:])
    m("unpadded base64", Signature=sig.replace("=:", ":"))
    m("non-canonical base64", Signature=sig[:-4] + ("B" if sig[-4] == "A" else "A") + "=:")
    m("signature flipped", Signature=sig[:8] + ("B" if sig[8] == "A" else "A") + sig[9:])
    m("no signature", Signature=None)
    m("no signature-input", Signature_Input=None)
    m("no digest", Content_Digest=None)
    return out


@pytest.mark.parametrize("node", [None, "node-1"])
def test_mutated_requests_refused_by_both_or_accepted_alike(node: str | None) -> None:
    url = "http://h:7390/api/v1/gpus"
    headers, _ = KEY.sign_request("POST", url, node_id=node, body=b"{}")
    for name, mutated, body, murl in _mutations(headers):
        req = Request("POST", murl or url, Headers(mutated))
        b = b"{}" if body is None else body
        lib, fast = library_result(req, b), fast_verify(req, b)
        assert fast is None or fast == lib, name  # the fast path never accepts what the library refuses
        if name in ("outer whitespace",):
            assert fast == lib and fast is not None, name
        via_key: Any
        try:
            via_key = KEY.verify_request(req, b)
        except Exception:  # noqa: BLE001
            via_key = None
        assert via_key == lib, name  # FleetKey's decision (fast path, then the library) is the library's


@pytest.mark.parametrize("offset,accepted", [(-MAX_SKEW - 2, False), (-MAX_SKEW + 2, True),
                                             (MAX_SKEW - 2, True), (MAX_SKEW + 2, False)])
def test_created_window(offset: float, accepted: bool) -> None:
    url = "http://h:7390/api/v1/gpus"
    headers, _ = KEY.sign_request("GET", url, now=time.time() + offset)
    req = Request("GET", url, Headers(headers))
    assert (fast_verify(req, b"") is not None) == accepted
    assert (library_result(req, b"") is not None) == accepted


def test_another_fleet_is_refused() -> None:
    url = "http://h:7390/api/v1/gpus"
    headers, _ = FleetKey("another-fleet-secret-0123456789").sign_request("GET", url)
    req = Request("GET", url, Headers(headers))
    assert fast_verify(req, b"") is None
    from http_message_signatures import InvalidSignature

    with pytest.raises(InvalidSignature, match="unknown key id"):
        KEY.verify_request(req, b"")


# -- responses ------------------------------------------------------------------------------------
def _response(node: str, fp: str | None, host: str | None, addrs: list[str], body: bytes | None,
              status: int = 200) -> tuple[Response, str]:
    url = "http://gpu-01:7390/api/v1/gpus?x=1"
    headers, nonce = KEY.sign_request("GET", url, node_id=node)
    resp = Response(status, Request("GET", url, Headers(headers)), Headers())
    KEY.sign_response(resp, nonce, node, fp, body, host=host, addresses=addrs)
    return resp, nonce


def library_proof(resp: Response, body: bytes | None) -> Any:
    try:
        results = KEY._resp_verifier.verify(resp, max_age=datetime.timedelta(0), expect_tag=TAG_RESPONSE, body=body)
    except Exception:  # noqa: BLE001
        return None
    return results[0] if len(results) == 1 else None


def fast_proof(resp: Response, body: bytes | None) -> Any:
    return sigfast.verify_response(KEY.response_key, KEY.key_id, resp.status_code, resp.request.method,
                                   resp.request.url, resp.headers, body, MAX_SKEW)


@SETTINGS
@given(st.text(alphabet="abcdef0123456789-", min_size=1, max_size=20),
       st.one_of(st.none(), st.just("A" * 43)),
       st.one_of(st.none(), st.sampled_from(["gpu-01", "gpu 01", "hôte", "a;b"])),
       st.lists(st.sampled_from(["10.0.0.1", "::1", "fe80::1%eth0", "bad"]), max_size=3),
       st.one_of(st.none(), bodies), st.sampled_from([200, 404, 500]))
def test_response_signatures_agree(node: str, fp: str | None, host: str | None, addrs: list[str],
                                   body: bytes | None, status: int) -> None:
    resp, nonce = _response(node, fp, host, addrs, body, status)
    lib = library_proof(resp, body)
    assert lib is not None  # what the fast signer wrote verifies with the library
    assert fast_proof(resp, body) == lib
    assert fast_proof(resp, None) == library_proof(resp, None)
    proof = KEY.response_proof(resp, nonce, node_id=node, cert_fp=fp, body=body)
    assert proof is not None and proof.node_id == node


def test_response_library_signature_verifies_fast() -> None:
    from gpusd.wire.signing import LABEL, _apply

    url = "http://gpu-01:7390/api/v1/gpus"
    resp = Response(200, Request("GET", url, Headers()), Headers({"Gpusd-Node": "n1", "Gpusd-Host": "gpu-01"}))
    prepared = KEY._resp_signer.prepare(resp, key_id=KEY.key_id, nonce="abc", label=LABEL, tag=TAG_RESPONSE,
                                        created=datetime.datetime.now(datetime.timezone.utc),
                                        covered_component_ids=["@status", '"@authority";req', '"@path";req',
                                                               "gpusd-node", "gpusd-host"], body=b"{}")
    _apply(resp.headers, prepared.signature_params, KEY.response_key, prepared.signature_base)
    assert fast_proof(resp, b"{}") == library_proof(resp, b"{}") is not None
    assert fast_proof(resp, b"{ }") is None and library_proof(resp, b"{ }") is None


def test_mutated_responses() -> None:
    resp, nonce = _response("n1", None, "gpu-01", ["10.0.0.1"], b"{}")
    h = dict(resp.headers)
    cases = {
        "node changed": {"Gpusd-Node": "n2"},
        "host changed": {"Gpusd-Host": "evil"},
        "addrs changed": {"Gpusd-Addrs": "10.6.6.6"},
        "status changed": {},
        "reordered": {"Signature-Input": h["Signature-Input"].replace('"gpusd-host" "gpusd-addrs"',
                                                                      '"gpusd-addrs" "gpusd-host"')},
        "req dropped": {"Signature-Input": h["Signature-Input"].replace('"@path";req', '"@path"')},
        "bad base64": {"Signature": h["Signature"][:9] + "*" + h["Signature"][10:]},
    }
    for name, change in cases.items():
        r = Response(500 if name == "status changed" else 200, resp.request, Headers({**h, **change}))
        assert fast_proof(r, b"{}") is None, name
        assert library_proof(r, b"{}") is None, name
        assert KEY.response_proof(r, nonce, node_id="n1", body=b"{}") is None, name
    assert KEY.response_proof(resp, nonce, node_id="n1", body=b"{ }") is None  # another body
    assert KEY.response_proof(resp, "other", node_id="n1", body=b"{}") is None  # another request's nonce


def test_without_the_librarys_private_helpers_every_call_takes_the_library_path(monkeypatch) -> None:
    """An upgrade of http-message-signatures that moves the two private helpers the fast path reuses
    must cost speed, never a signature: each call then signs and checks through the library."""
    monkeypatch.setattr(sigfast, "_LIBRARY_OK", False)
    url = "http://h:7390/api/v1/gpus"
    headers, _ = KEY.sign_request("GET", url, node_id="node-1")
    assert sigfast.sign_request(KEY.request_key, KEY.key_id, "GET", url, "node-1", b"", "n" * 16, int(time.time())) \
        is None
    req = Request("GET", url, Headers(headers))
    assert fast_verify(req, b"") is None
    assert KEY.verify_request(req, b"").nonce  # the library's check, still accepting
    monkeypatch.setattr(sigfast, "_LIBRARY_OK", True)
    assert fast_verify(req, b"") is not None  # and the library-signed headers pass the fast check too


def test_fields_beside_gpusds_own_change_nothing() -> None:
    """The fast path reads only the fields gpusd's shapes cover; any other field (odd, folded,
    repeated) leaves both paths' answers alike."""
    url = "http://h:7390/api/v1/gpus"
    headers, _ = KEY.sign_request("GET", url, node_id="node-1")
    extra = {"Host": "h:7390", "User-Agent": "x\r\n y", "X-Other": " a ", "x-other": "b", "Accept": "*/*"}
    req = Request("GET", url, Headers({**extra, **headers}))
    assert fast_verify(req, b"") == library_verify(req, b"") is not None
    twice = Request("GET", url, Headers({**headers, "gpusd-node": "node-2"}))  # a covered field, repeated
    assert fast_verify(twice, b"") is None and library_result(twice, b"") is None


def test_a_remembered_body_digest_never_signs_another_body() -> None:
    """Answers signed over and over (the daemon's one body per sample) reuse their digest by identity;
    every other body, and each body after many others, is signed over its own bytes."""
    bodies = [bytes([i]) * 4096 for i in range(20)]
    for body in bodies + bodies[:3] + [bytes(bodies[0])]:
        resp, nonce = _response("n1", None, "gpu-01", ["10.0.0.1"], body)
        assert library_proof(resp, body) is not None
        assert KEY.response_proof(resp, nonce, node_id="n1", body=body) is not None
        other = body[:-1] + bytes([(body[-1] + 1) % 256])
        assert library_proof(resp, other) is None and KEY.response_proof(resp, nonce, "n1", body=other) is None


accounts_ = st.one_of(st.none(), st.text(alphabet="abcxyz09._-", min_size=1, max_size=32))
certs = st.one_of(st.none(), st.text(alphabet="ABCxyz09_-", min_size=43, max_size=43))


@SETTINGS
@given(methods, hosts, paths, nodes, accounts_, certs, bodies)
def test_the_account_and_certificate_shapes_agree_with_the_library(method: str, host: str, path: str,
                                                                   node: str | None, account: str | None,
                                                                   cert: str | None, body: bytes) -> None:
    """gpusd 0.4's covered ``gpusd-user`` and ``gpusd-cert`` (each optional, in the shape's order): the
    fast signer writes what the library writes, each verifies the other's, and changing either header
    afterwards breaks the signature on both paths."""
    from gpusd.wire.signing import LABEL, _apply

    url = f"https://{host}{path}"
    created, nonce = int(time.time()), "n0nce-" + str(len(path))
    fast = sigfast.sign_request(KEY.request_key, KEY.key_id, method, url, node, body, nonce, created, account, cert)
    req = Request(method, url, Headers())
    covered = ["@method", "@authority", "@path", "@query"]
    for name, value in (("Gpusd-Node", node), ("Gpusd-User", account), ("Gpusd-Cert", cert)):
        if value:
            req.headers[name] = value
            covered.append(name.lower())
    try:
        prepared = KEY._req_signer.prepare(req, key_id=KEY.key_id, nonce=nonce, label=LABEL, tag=TAG_REQUEST,
                                           created=datetime.datetime.fromtimestamp(created, datetime.timezone.utc),
                                           covered_component_ids=covered, body=body)
    except Exception:  # noqa: BLE001 - values the library refuses: the fast signer declines them too
        assert fast is None
        return
    _apply(req.headers, prepared.signature_params, KEY.request_key, prepared.signature_base)
    assert fast is not None and fast[0] == dict(req.headers)
    signed = Request(method, url, Headers(fast[0]))
    result = library_verify(signed, body)
    assert fast_verify(signed, body) == result
    assert result.covered_components.get('"gpusd-user"') == (account or None)
    assert result.covered_components.get('"gpusd-cert"') == (cert or None)
    for name in ("Gpusd-User", "Gpusd-Cert"):
        if name in fast[0]:
            changed = Request(method, url, Headers({**fast[0], name: fast[0][name] + "x"}))
            assert fast_verify(changed, body) is None and library_result(changed, body) is None
