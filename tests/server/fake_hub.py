"""A small stand-in for the Hugging Face Hub on 127.0.0.1, for huggingface_hub's download path.

It serves one model repo from a local folder through the few endpoints ``snapshot_download``
calls: the repo info (``/api/models/<repo>/revision/<rev>``: its commit sha), the tree listing
(``/api/models/<repo>/tree/<rev>``), and ``HEAD``/``GET`` of ``/<repo>/resolve/<rev>/<file>``
with the ``X-Repo-Commit`` and ``ETag`` headers the client caches by. Files named in
``slow_files`` are sent in small pieces spread over ``throttle_seconds``: a slow network, so a
test can make an adapter's load take long honestly (huggingface_hub really downloads it). With
a ``gate``, they are sent only once it is set: a load held for as long as the test needs.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the repo's one commit (40 hex digits)


class FakeHub:
    def __init__(self, repo_id: str, folder: Path, slow_files: frozenset[str] = frozenset(),
                 throttle_seconds: float = 0.0, gate: threading.Event | None = None) -> None:
        self.repo_id, self.folder = repo_id, folder
        self.gate = gate
        self.slow_files, self.throttle_seconds = slow_files, throttle_seconds
        self.files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        self.downloads: list[str] = []  # the files GET sent, in order
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _tree(self) -> list[dict[str, object]]:
        return [{"type": "file", "path": name, "size": len(data), "oid": _etag(data)}
                for name, data in self.files.items()]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                path = unquote(urlparse(self.path).path)
                api = f"/api/models/{hub.repo_id}/"
                resolve = f"/{hub.repo_id}/resolve/"
                if path.startswith(api + "revision/"):
                    self._json({"id": hub.repo_id, "sha": COMMIT,
                                "siblings": [{"rfilename": name} for name in hub.files]}, body)
                elif path.startswith(api + "tree/"):
                    self._json(hub._tree(), body)
                elif path.startswith(resolve):
                    name = path[len(resolve):].partition("/")[2]
                    if name not in hub.files:
                        self._not_found()
                    else:
                        self._file(name, body)
                else:
                    self._not_found()

            def _json(self, payload: object, body: bool) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _file(self, name: str, body: bool) -> None:
                data = hub.files[name]
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("ETag", f'"{_etag(data)}"')
                self.send_header("X-Repo-Commit", COMMIT)
                self.end_headers()
                if not body:
                    return
                hub.downloads.append(name)
                if name not in hub.slow_files:
                    self.wfile.write(data)
                    return
                if hub.gate is not None:
                    hub.gate.wait()
                pieces = 30
                step = -(-len(data) // pieces)
                for start in range(0, len(data), step):
                    time.sleep(hub.throttle_seconds / pieces)
                    self.wfile.write(data[start : start + step])
                    self.wfile.flush()

            def _not_found(self) -> None:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler


def _etag(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()
