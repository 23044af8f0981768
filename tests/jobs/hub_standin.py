"""A local stand-in for the Hugging Face hub: the endpoints huggingface_hub's snapshot_download calls.

    GET  /api/models/{org}/{name}/revision/{rev}     {"id", "sha", "siblings": [{"rfilename"}]}
    GET  /api/models/{org}/{name}/tree/{rev}         [{"type": "file", "path", "size", "oid", "lfs"}]
    HEAD /{org}/{name}/resolve/{rev}/{file}          X-Repo-Commit, ETag (X-Linked-Etag), Content-Length
    GET  /{org}/{name}/resolve/{rev}/{file}          the bytes, with the same headers

A gated repo answers 401 with `X-Error-Code: GatedRepo` (as the hub does) unless the request carries
its token. Each served file is counted, so a test can say how many files and bytes were fetched.
Point huggingface_hub at it with HF_ENDPOINT=server.url.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class HubRepo:
    def __init__(self, folder: Path, gated_token: str | None = None) -> None:
        self.files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        digest = hashlib.sha1(b"".join(k.encode() + v for k, v in self.files.items())).hexdigest()
        self.sha = digest  # 40 hex: the "commit"
        self.gated_token = gated_token


class HubStandIn:
    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.fetched: list[tuple[str, str, int]] = []  # (repo, file, bytes) of each GET of a file
        self.auth_seen: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add(self, repo: str, folder: Path, gated_token: str | None = None) -> HubRepo:
        self.repos[repo] = HubRepo(folder, gated_token)
        return self.repos[repo]

    def start(self) -> "HubStandIn":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
                      head: bool = False) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _json(self, status: int, obj: object, headers: dict[str, str] | None = None) -> None:
                self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

            def _repo(self, repo: str, head: bool = False) -> HubRepo | None:
                r = hub.repos.get(repo)
                if r is None:
                    self._send(404, b'{"error": "Repository not found"}',
                               {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}, head)
                    return None
                auth = self.headers.get("Authorization", "")
                if auth:
                    hub.auth_seen.append(auth)
                if r.gated_token is not None and auth != f"Bearer {r.gated_token}":
                    msg = f"Access to model {repo} is restricted. You must have access to it and be authenticated."
                    self._send(401, json.dumps({"error": msg}).encode(),
                               {"X-Error-Code": "GatedRepo", "X-Error-Message": msg}, head)
                    return None
                return r

            def do_HEAD(self) -> None:
                self._serve(head=True)

            def do_GET(self) -> None:
                self._serve(head=False)

            def _serve(self, head: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                    repo = f"{parts[2]}/{parts[3]}"
                    r = self._repo(repo, head)
                    if r is None:
                        return
                    if parts[4] == "revision":
                        self._json(200, {"id": repo, "modelId": repo, "sha": r.sha, "private": False,
                                         "gated": r.gated_token is not None and "manual",
                                         "siblings": [{"rfilename": f} for f in r.files]})
                    else:
                        self._json(200, [{"type": "file", "path": f, "size": len(b),
                                          "oid": hashlib.sha1(b).hexdigest(),
                                          "lfs": {"oid": hashlib.sha256(b).hexdigest(), "size": len(b),
                                                  "pointerSize": 130}}
                                         for f, b in r.files.items()])
                    return
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo = f"{parts[0]}/{parts[1]}"
                    r = self._repo(repo, head)
                    if r is None:
                        return
                    name = "/".join(parts[4:])
                    if parts[3] not in ("main", r.sha):
                        self._send(404, b"", {"X-Error-Code": "RevisionNotFound"}, head)
                        return
                    body = r.files.get(name)
                    if body is None:
                        self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                        return
                    etag = f'"{hashlib.sha256(body).hexdigest()}"'
                    if not head:
                        hub.fetched.append((repo, name, len(body)))
                    self._send(200, body, {"X-Repo-Commit": r.sha, "ETag": etag, "X-Linked-Etag": etag,
                                           "X-Linked-Size": str(len(body)),
                                           "Content-Type": "application/octet-stream"}, head)
                    return
                self._send(404, b"")

        return Handler
