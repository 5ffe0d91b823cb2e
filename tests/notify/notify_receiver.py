"""A webhook receiver for the notify tests, bound to 127.0.0.1 (of the namespace it runs in).

``python notify_receiver.py OUT [MODE]`` prints its port, then appends one JSON line per request to OUT
(``{"path", "headers", "body"}``) and one line per connection accepted to OUT.conns.  MODE: ``ok``
(200, the default), ``silent`` (accepts, reads, never answers), ``fail:N`` (503 to the first N
requests, then 200), ``gone`` (410), ``redirect`` (307 to /elsewhere).  It stops when signalled, or after 120 s."""

from __future__ import annotations

import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    out: Path
    mode: str
    failures = 0

    def get_request(self) -> tuple[socket.socket, object]:
        conn, addr = super().get_request()
        with open(str(self.out) + ".conns", "a") as f:
            f.write("conn\n")
        return conn, addr


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(min(int(self.headers.get("Content-Length") or 0), 1 << 20))
        s = self.server
        if s.mode == "silent":
            threading.Event().wait(300)  # never answers (the client's timeout ends it)
            return
        with open(s.out, "a") as f:
            f.write(json.dumps({"path": self.path, "headers": dict(self.headers), "body": body.decode()}) + "\n")
        status = 200
        if s.mode.startswith("fail:") and s.failures < int(s.mode[5:]):
            s.failures += 1
            status = 503
        elif s.mode == "gone":
            status = 410
        elif s.mode == "redirect":
            status = 307
        self.send_response(status)
        if status == 307:
            self.send_header("Location", "/elsewhere")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")


def serve(out: Path, mode: str = "ok") -> _Server:
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.out, srv.mode = out, mode
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


if __name__ == "__main__":
    server = serve(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "ok")
    print(server.server_address[1], flush=True)
    threading.Event().wait(120)  # bounded: the test ends it sooner (SIGTERM)
