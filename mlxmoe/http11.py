"""HTTP/1.1 for a BaseHTTPRequestHandler (mlx-lm's server's): keep-alive, with every response
framed (its Content-Length, else chunked, else the connection closes after it); chunked request
bodies; HEAD; timeouts: a connection idle between requests, or a request whose line and headers
take longer than the timeout in all (a client sending them a byte at a time), is closed.
The stdlib's handler does the rest (parsing, Expect: 100-continue, Connection: close)."""

import io
import re
import socket
import time
from http.server import BaseHTTPRequestHandler

CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")


class TooLarge(ValueError):
    """A request body beyond the limit, refused before the rest of it is read."""

    def __init__(self, size, most):
        super().__init__(f"request body of {size} bytes or more: more than the {most} a request may hold")
        self.size, self.most = size, most


def read_chunked(rfile, most):
    """A chunked request body (RFC 9112 section 7.1) read from `rfile`: ValueError if malformed,
    TooLarge as soon as a chunk's size line takes it past `most` bytes (its data unread)."""
    parts, size = [], 0
    while True:
        line = rfile.readline(1024)
        size_field = line.split(b";", 1)[0].strip()  # (chunk extensions ignored)
        if not line.endswith(b"\n") or not CHUNK_SIZE.fullmatch(size_field):
            raise ValueError(f"request body: chunked, but {line[:40]!r} is not a chunk size (hex digits)")
        n = int(size_field, 16)
        if n == 0:
            break
        size += n
        if size > most:
            raise TooLarge(size, most)
        data = rfile.read(n)
        if len(data) < n or rfile.readline(3) not in (b"\r\n", b"\n"):
            raise ValueError("request body: chunked, but a chunk is cut short or not followed by CRLF")
        parts.append(data)
    for _ in range(64):  # trailer fields, dropped, until the empty line
        if rfile.readline(8192) in (b"\r\n", b"\n", b""):
            return b"".join(parts)
    raise ValueError("request body: chunked, with more than 64 trailer lines")


class HeadReader(socket.SocketIO):
    """The connection's reader: while `deadline` is set (a request's line and headers arriving)
    every read waits at most until then, not the socket's timeout per read."""

    deadline = None

    def readinto(self, b):
        if self.deadline is None:
            return super().readinto(b)
        try:
            self._sock.settimeout(max(self.deadline - time.monotonic(), 1e-3))
            return super().readinto(b)
        except TimeoutError:
            raise TimeoutError("the request's line and headers took longer than the timeout") from None


class Framing:
    """The connection's writer: bytes pass as they are; after the headers of a response without
    a Content-Length each write is one chunk ("chunked"), and a HEAD's body is dropped ("drop")."""

    def __init__(self, out):
        self.out, self.mode = out, None

    def write(self, data):
        try:
            if self.mode is None:
                return self.out.write(data)
            if self.mode == "chunked" and data:  # (an empty chunk would end the body)
                self.out.write(b"%x\r\n%s\r\n" % (len(data), bytes(data)))
            return len(data)
        except OSError:  # (a write timed out, or the client went away)
            self.mode = None  # a response cut short gets no last chunk
            raise

    def end(self):
        """The end of a response: the last chunk of a chunked one."""
        mode, self.mode = self.mode, None
        if mode == "chunked":
            self.out.write(b"0\r\n\r\n")

    def flush(self):
        self.out.flush()

    @property
    def closed(self):
        return self.out.closed

    def close(self):
        self.out.close()


class KeepAlive(BaseHTTPRequestHandler):
    """HTTP/1.1 on a handler whose routes may write a body with or without a Content-Length.
    `server.idle_timeout` (seconds, or None: no timeouts) bounds an idle connection, a request's
    head in all, and each read or write after it. `body_read` is set by whoever reads a request's
    body: one left unread closes the connection (its bytes would be taken for the next request)."""

    protocol_version = "HTTP/1.1"
    status = None  # of the response under way
    framed = False  # its headers say how long its body is (Content-Length or Transfer-Encoding)
    body_read = False

    def setup(self):
        self.timeout = getattr(self.server, "idle_timeout", None)
        super().setup()
        self.reader = HeadReader(self.connection, "rb")
        self.rfile = io.BufferedReader(self.reader)
        self.framing = self.wfile = Framing(self.wfile)

    def handle_one_request(self):
        try:
            waiting = self.rfile.peek(1)  # the next request's first byte, up to the timeout
        except (TimeoutError, ConnectionError):  # idle past the timeout, or reset between requests
            waiting = b""
        if not waiting:  # closed quietly
            self.close_connection = True
            return
        if self.timeout is not None:
            self.reader.deadline = time.monotonic() + self.timeout
        self.body_read = False
        try:
            super().handle_one_request()  # (a timeout there: logged, the connection closed)
            self.framing.end()
        except ConnectionError:
            self.went_away()
        if not self.body_read and self._has_body():
            self.close_connection = True

    def went_away(self):
        """The client closed or reset its connection before its answer: one line, the connection ended."""
        self.close_connection = True
        self.framing.mode = None  # (no last chunk for a response cut short)
        self.log_message('"%s": the client went away before its answer', getattr(self, "requestline", ""))

    def _has_body(self):
        headers = getattr(self, "headers", None)
        return headers is not None and ("Transfer-Encoding" in headers
                                        or headers.get("Content-Length", "0").strip() not in ("", "0"))

    def parse_request(self):
        ok = super().parse_request()
        self.reader.deadline = None
        self.connection.settimeout(self.timeout)  # (each read or write from here on)
        return ok

    def send_response_only(self, code, message=None):
        self.status, self.framed = code, False
        super().send_response_only(code, message)

    def send_header(self, keyword, value):
        if keyword.lower() in ("content-length", "transfer-encoding"):
            self.framed = True
        super().send_header(keyword, value)

    def end_headers(self):
        """The headers, framing a response with no Content-Length: chunked for an HTTP/1.1
        client, for an HTTP/1.0 one by closing the connection after it."""
        final = self.status is not None and self.status >= 200  # (not 100 Continue)
        no_body = final and (self.command == "HEAD" or self.status in (204, 304))
        chunked = final and not no_body and not self.framed and self.request_version == "HTTP/1.1"
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        elif final and not no_body and not self.framed:
            self.send_header("Connection", "close")
        super().end_headers()
        if final:
            self.framing.mode = "drop" if no_body else "chunked" if chunked else None

    def do_HEAD(self):
        """A GET route's headers without its body (Framing drops it)."""
        self.do_GET()
