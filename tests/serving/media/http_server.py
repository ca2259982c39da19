"""A real HTTP server on 127.0.0.1 for the fetch tests, with a route per misbehaviour, counting what it sees:
connections open at once (and the most ever), bytes it managed to send, Host headers."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from urllib.parse import parse_qs, urlsplit


class MediaServer:
    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files  # path -> body
        self.lock = threading.Lock()
        self.num_open = 0  # connections
        self.most_open = 0
        self.num_holding = 0  # /hold requests being answered
        self.most_holding = 0
        self.num_requests = 0
        self.hosts: list[str] = []
        self.num_bytes_sent = 0  # by /endless, before the client went away
        self.endless_done = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                # Small kernel buffers, so that bytes the client never read cannot hide in them.
                self.request.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * 1024)
                super().setup()
                with server.lock:
                    server.num_open += 1
                    server.most_open = max(server.most_open, server.num_open)

            def finish(self) -> None:
                try:
                    super().finish()
                finally:
                    with server.lock:
                        server.num_open -= 1

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                with server.lock:
                    server.num_requests += 1
                    server.hosts.append(self.headers.get("Host", ""))
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                route = getattr(self, "route_" + url.path.strip("/").split("/")[0], None)
                if route is not None:
                    route(query)
                elif url.path in server.files:
                    self.send(200, server.files[url.path])
                else:
                    self.send(404, b"not found")

            def send(self, status: int, body: bytes, **headers: str) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                for name, value in headers.items():
                    self.send_header(name.replace("_", "-"), value)
                self.end_headers()
                self.wfile.write(body)

            def route_redirect(self, query: dict[str, str]) -> None:
                self.send(int(query.get("status", "302")), b"", Location=query["to"])

            def route_hold(self, query: dict[str, str]) -> None:
                with server.lock:
                    server.num_holding += 1
                    server.most_holding = max(server.most_holding, server.num_holding)
                time.sleep(float(query.get("seconds", "0.3")))
                with server.lock:
                    server.num_holding -= 1
                self.send(200, server.files["/image.png"])

            def route_slow(self, query: dict[str, str]) -> None:
                time.sleep(float(query.get("seconds", "3")))
                self.send(200, b"late")

            def route_drip(self, query: dict[str, str]) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                try:
                    for _ in range(1000):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(0.1)
                except OSError:
                    pass

            def route_gzip(self, query: dict[str, str]) -> None:
                self.send(200, b"\x1f\x8b" + b"\0" * 30, Content_Encoding="gzip")

            def route_declared(self, query: dict[str, str]) -> None:
                self.send_response(200)
                self.send_header("Content-Length", query["length"])
                self.end_headers()
                self.wfile.write(b"\0" * 16)

            def route_endless(self, query: dict[str, str]) -> None:
                """No Content-Length: the cap can only be enforced while reading."""
                self.send_response(200)
                self.send_header("Connection", "close")
                self.end_headers()
                chunk = b"\0" * 16384
                try:
                    for _ in range(int(query.get("chunks", "16384"))):  # 256 MiB
                        self.wfile.write(chunk)
                        with server.lock:
                            server.num_bytes_sent += len(chunk)
                except OSError:
                    pass
                finally:
                    server.endless_done.set()

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
