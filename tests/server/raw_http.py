"""HTTP/1.1 over a plain socket, for what an HTTP client library will not do: stall in the headers or the body,
send a false ``Content-Length``, keep one connection across requests and see whether the server closed it.
"""

from __future__ import annotations

import json
import socket
from typing import Optional
from urllib.parse import urlsplit

TIMEOUT_S = 30.0  # a bound on a hang, never a timing assumption


def connect(url: str, timeout: float = TIMEOUT_S) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def request_bytes(method: str, path: str, body: Optional[bytes] = None, headers: Optional[dict] = None) -> bytes:
    """One request's bytes; a ``Content-Length`` of ``body`` unless ``headers`` gives the framing."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    headers = dict(headers or {})
    if body is not None:
        headers.setdefault("Content-Type", "application/json")
        if "Transfer-Encoding" not in headers:
            headers.setdefault("Content-Length", str(len(body)))
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)


def read_response(sock: socket.socket) -> Response:
    """One response with a ``Content-Length`` body (what the server sends for everything but streams)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"the server closed the connection before a whole response: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection inside a response body")
        rest += chunk
    return Response(int(status_line.split()[1]), headers, rest[:length])


def is_closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (waits up to the socket's timeout for the end of the stream)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def exchange(url: str, method: str, path: str, body: Optional[bytes] = None) -> Response:
    with connect(url) as sock:
        sock.sendall(request_bytes(method, path, body, {"Connection": "close"}))
        return read_response(sock)
