"""An HTTP proxy in front of the S3 server that injects faults on request: server errors, slow answers
(timeouts) and bodies cut short (truncated reads). Faults are injected at the storage boundary — the network
between Kiln and S3 — while the S3 server itself stays real."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FaultProxy:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.lock = threading.Lock()
        self.faults: list[dict] = []  # {"method", "kind": error|slow|truncate, "status", "seconds", "left"}
        self.seen: list[tuple[str, str, str]] = []  # (method, path, outcome)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fault = proxy._take(self.command)
                if fault and fault["kind"] == "error":
                    proxy.seen.append((self.command, self.path, f"error {fault['status']}"))
                    payload = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
                    self.send_response(fault["status"])
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                if fault and fault["kind"] == "slow":
                    proxy.seen.append((self.command, self.path, "slow"))
                    time.sleep(fault["seconds"])
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if fault and fault["kind"] == "truncate" and len(data) > 1:
                    proxy.seen.append((self.command, self.path, "truncated"))
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                else:
                    proxy.seen.append((self.command, self.path, str(resp.status)))
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def inject(self, method: str, kind: str, times: int = 1, status: int = 500, seconds: float = 0.0):
        with self.lock:
            self.faults.append({"method": method, "kind": kind, "status": status, "seconds": seconds, "left": times})

    def _take(self, method: str) -> dict | None:
        with self.lock:
            for f in self.faults:
                if f["method"] == method and f["left"] > 0:
                    f["left"] -= 1
                    return f
        return None

    def clear(self):
        with self.lock:
            self.faults.clear()

    def close(self):
        self.server.shutdown()
