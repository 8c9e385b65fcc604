"""A local stand-in for the Hugging Face Hub, speaking what the installed ``huggingface_hub`` asks.

Endpoints (read from ``huggingface_hub``'s ``hf_api.py`` / ``file_download.py``):

* ``GET /api/models/{org}/{name}[/revision/{rev}]``: model info (``sha``, ``siblings``);
* ``GET /api/models/{org}/{name}/tree/{rev}``: the file list (``type``, ``path``, ``size``, ``oid``);
* ``HEAD|GET /{org}/{name}/resolve/{rev}/{file}``: the file, with ``ETag`` (its sha256),
  ``X-Repo-Commit``, ``Content-Length``, ``Accept-Ranges`` and ``Range`` → 206 + ``Content-Range``.

``FakeHub.script[file]`` lists what the next GETs of a file do: ``("cut", n)`` sends the headers
of the whole range and only ``n`` bytes of it, then drops the connection (an interrupted
download); ``("error", code)`` answers with that status.  Every request is logged in
``FakeHub.requests`` as ``(method, path, headers)``.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}
        self.script: dict[str, list[tuple[str, int]]] = {}
        self.requests: list[tuple[str, str, dict]] = []
        self._server: ThreadingHTTPServer | None = None

    def add_repo(self, repo: str, files: dict[str, bytes], commit: str | None = None) -> str:
        commit = commit or hashlib.sha1(repo.encode() + "".join(sorted(files)).encode()).hexdigest()
        self.repos[repo] = {"commit": commit, "files": dict(files)}
        return commit

    def add_folder(self, repo: str, folder: Path, extra: dict[str, bytes] | None = None) -> str:
        files = {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}
        return self.add_repo(repo, {**files, **(extra or {})})

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def gets(self, name: str) -> list[dict]:
        """Headers of the GET requests for files named ``name``."""
        return [
            h
            for m, p, h in self.requests
            if m == "GET" and "/resolve/" in p and p.endswith("/" + name)
        ]

    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(head=True)

            def do_GET(self) -> None:
                self._serve(head=False)

            def _json(self, obj) -> None:
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _missing(self, what: str) -> None:
                body = json.dumps({"error": what}).encode()
                self.send_response(404)
                self.send_header(
                    "X-Error-Code", "RepoNotFound" if "repo" in what else "EntryNotFound"
                )
                self.send_header("X-Error-Message", what)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _serve(self, head: bool) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path, dict(self.headers)))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo = hub.repos.get("/".join(parts[2:4]))
                    if repo is None:
                        return self._missing("repo not found")
                    rev = parts[5] if len(parts) > 5 else "main"
                    if rev not in ("main", repo["commit"]):
                        return self._missing("revision not found")
                    if len(parts) > 4 and parts[4] == "tree":
                        return self._json(
                            [
                                {
                                    "type": "file",
                                    "path": f,
                                    "size": len(b),
                                    "oid": hashlib.sha1(b).hexdigest(),
                                }
                                for f, b in sorted(repo["files"].items())
                            ]
                        )
                    return self._json(
                        {
                            "id": "/".join(parts[2:4]),
                            "modelId": "/".join(parts[2:4]),
                            "sha": repo["commit"],
                            "private": False,
                            "siblings": [{"rfilename": f} for f in sorted(repo["files"])],
                        }
                    )
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo = hub.repos.get("/".join(parts[:2]))
                    name = "/".join(parts[4:])
                    if repo is None:
                        return self._missing("repo not found")
                    if parts[3] not in ("main", repo["commit"]) or name not in repo["files"]:
                        return self._missing("entry not found")
                    return self._file(repo, name, head)
                return self._missing("not found")

            def _file(self, repo: dict, name: str, head: bool) -> None:
                data = repo["files"][name]
                action = None
                if not head and hub.script.get(name):
                    action = hub.script[name].pop(0)
                if action and action[0] == "error":
                    self.send_response(action[1])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0])
                    end = rng[6:].split("-")[1]
                    stop = int(end) + 1 if end else len(data)
                else:
                    stop = len(data)
                body = data[start:stop]
                self.send_response(206 if rng else 200)
                self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
                self.send_header("X-Repo-Commit", repo["commit"])
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(body)))
                if rng:
                    self.send_header(
                        "Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(data)}"
                    )
                self.end_headers()
                if head:
                    return
                if action and action[0] == "cut":
                    self.wfile.write(body[: action[1]])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
