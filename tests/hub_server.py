"""A fake Hugging Face hub for tests: the few endpoints huggingface_hub calls to pin a revision
and download a snapshot, served from local folders on 127.0.0.1.

    with FakeHub() as hub:              # hub.url is what HF_ENDPOINT points at
        hub.add("org/tiny", folder)     # a commit of every file in folder, on branch main
        hub.add("org/tiny", other)      # main moves to a second commit

Endpoints: `GET /api/{models,datasets}/{repo}/revision/{rev}` (the revision's commit),
`GET /api/{models,datasets}/{repo}/tree/{sha}` (the files, recursive), and `HEAD`/`GET
/{repo}/resolve/{sha}/{file}` (`datasets/{repo}/...` for a dataset) with `X-Repo-Commit` and
`ETag`. A repo made `gated` answers 403 with `X-Error-Code: GatedRepo` to requests without a
token; an unknown repo 404 `RepoNotFound`; an unknown revision 404 `RevisionNotFound`.
Every request's path and Authorization header are kept in `requests`; a file named in `slow`
is sent that many seconds after its request (a download under way others can see).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> files
    refs: dict[str, str] = field(default_factory=dict)  # branch -> sha
    gated: bool = False


class FakeHub:
    """The server, started on entering and shut down on leaving."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str, str]] = []  # (method, path, Authorization)
        self.slow: dict[str, float] = {}  # file name -> seconds before its body is sent
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def add(self, repo: str, folder: Path, repo_type: str = "model", branch: str = "main") -> str:
        """A new commit of `folder`'s files at the head of `branch`; its sha."""
        files = {
            str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }
        held = self.repos.setdefault((repo_type, repo), Repo())
        digest = hashlib.sha1(repr((repo, len(held.commits))).encode())
        for name, data in files.items():
            digest.update(name.encode() + hashlib.sha1(data).digest())
        sha = digest.hexdigest()
        held.commits[sha] = files
        held.refs[branch] = sha
        return sha


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Authorization", "")))
            parts = path.strip("/").split("/")
            if len(parts) < 5 or (parts[0] == "api" and len(parts) < 6):
                self._error(404, "EntryNotFound")
            elif parts[0] == "api":
                repo_type = parts[1].rstrip("s")
                self._api(repo_type, "/".join(parts[2:4]), parts[4], "/".join(parts[5:]))
            elif parts[0] == "datasets":
                self._file("dataset", "/".join(parts[1:3]), parts[4], "/".join(parts[5:]), body)
            else:
                self._file("model", "/".join(parts[0:2]), parts[3], "/".join(parts[4:]), body)

        def _repo(self, repo_type: str, repo: str) -> Repo | None:
            held = hub.repos.get((repo_type, repo))
            if held is None:
                self._error(404, "RepoNotFound")
                return None
            if held.gated and not self.headers.get("Authorization"):
                self._error(403, "GatedRepo")
                return None
            return held

        def _sha(self, held: Repo, rev: str) -> str | None:
            sha = held.refs.get(rev, rev if rev in held.commits else None)
            if sha is None:
                self._error(404, "RevisionNotFound")
            return sha

        def _api(self, repo_type: str, repo: str, what: str, rev: str) -> None:
            held = self._repo(repo_type, repo)
            if held is None:
                return
            sha = self._sha(held, rev)
            if sha is None:
                return
            files = held.commits[sha]
            if what == "revision":
                data: Any = {
                    "id": repo,
                    "sha": sha,
                    "private": False,
                    "siblings": [{"rfilename": n} for n in files],
                }
            else:  # tree
                data = [
                    {"type": "file", "path": n, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for n, b in files.items()
                ]
            self._send(200, json.dumps(data).encode(), {"Content-Type": "application/json"})

        def _file(self, repo_type: str, repo: str, rev: str, name: str, body: bool) -> None:
            held = self._repo(repo_type, repo)
            if held is None:
                return
            sha = self._sha(held, rev)
            if sha is None:
                return
            data = held.commits[sha].get(name)
            if data is None:
                self._error(404, "EntryNotFound")
                return
            headers = {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
            if body and name in hub.slow:
                time.sleep(hub.slow[name])
            self._send(200, data if body else b"", headers, length=len(data))

        def _error(self, status: int, code: str) -> None:
            self._send(status, b"{}", {"X-Error-Code": code, "Content-Type": "application/json"})

        def _send(
            self, status: int, data: bytes, headers: dict[str, str], length: int | None = None
        ) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data) if length is None else length))
            self.end_headers()
            if data:
                self.wfile.write(data)

    return Handler
