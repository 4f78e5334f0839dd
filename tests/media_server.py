"""A small real HTTP server on 127.0.0.1 that serves the media URLs the fetch tests ask for: a PNG,
a redirect to it (and one to it on 127.0.0.1 by name, from another host name), a redirect loop, a 404, an HTML page, a body that never ends and an endpoint
that answers too late."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vlm_models import random_image

SLOW_SECONDS = 10.0  # far past the tests' fetch timeouts; released early when the server stops


@dataclass
class MediaServer:
    url: str  # http://127.0.0.1:PORT
    png: bytes  # what /seven.png serves: random_image(7) as a PNG
    # /held.png: set when it is asked for; it answers (the PNG) once the test sets release_held
    held_requested: threading.Event
    release_held: threading.Event

    def at(self, path: str, host: str = "127.0.0.1") -> str:
        return self.url.replace("127.0.0.1", host) + path


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@contextmanager
def media_server() -> Iterator[MediaServer]:
    png = png_bytes(random_image(7))
    release = threading.Event()
    held_requested, release_held = threading.Event(), threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            route = {"/seven.png": self._png, "/redirect": lambda: self._redirect("/seven.png"),
                     "/loop": lambda: self._redirect("/loop"),
                     "/elsewhere": lambda: self._redirect(f"http://127.0.0.1:{self.server.server_address[1]}/seven.png"), "/page.html": self._html,
                     "/endless.png": self._endless, "/slow.png": self._slow, "/held.png": self._held}.get(self.path)
            if route is None:
                self.send_error(404, "no such media")
            else:
                route()

        def _png(self) -> None:
            self._answer(png, "image/png")

        def _html(self) -> None:
            self._answer(b"<html><body>not an image</body></html>", "text/html; charset=utf-8")

        def _redirect(self, target: str) -> None:
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _endless(self) -> None:  # an image/png body with no length that never ends
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            chunk = b"\0" * 65536
            try:
                while not release.is_set():
                    self.wfile.write(chunk)
            except (BrokenPipeError, ConnectionResetError):  # the client stopped reading: expected
                pass
            self.close_connection = True

        def _slow(self) -> None:
            release.wait(SLOW_SECONDS)
            try:
                self._answer(png, "image/png")
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _held(self) -> None:
            held_requested.set()
            release_held.wait(SLOW_SECONDS)
            try:
                self._answer(png, "image/png")
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _answer(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield MediaServer(f"http://127.0.0.1:{httpd.server_address[1]}", png, held_requested, release_held)
    finally:
        release.set()
        release_held.set()
        httpd.shutdown()
        httpd.server_close()
