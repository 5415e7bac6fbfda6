"""A loopback fake of the Hugging Face Hub HTTP API: just what `huggingface_hub` needs to create a repo, commit
regular (non-LFS) files, and serve them back to `hf_hub_download`. Files live in memory; nothing leaves 127.0.0.1.

Run it alone for the example: `python tests/_hub_server.py` prints the endpoint to use as `HF_ENDPOINT`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import unquote, urlparse

_REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
_REV = r"(?P<rev>[^/]+)"


@dataclass
class Repo:
    commits: list[tuple[str, dict[str, bytes]]] = field(default_factory=list)  # (oid, full file snapshot)

    def snapshot(self, revision: str) -> Optional[tuple[str, dict[str, bytes]]]:
        if revision == "main":
            return self.commits[-1] if self.commits else ("0" * 40, {})
        return next((c for c in self.commits if c[0] == revision), None)


def _looks_like_local_path(value: str) -> bool:
    return value.startswith(("/", ".", "~")) or "\\" in value or value.count("/") > 1


class FakeHub:
    """In-memory repos plus the request log; `url` is the endpoint to hand to `HF_ENDPOINT`."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.unhandled: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        return dict(self.repos[repo_id].snapshot(revision)[1])

    # ------------------------------------------------------------------ API routes, each -> (status, headers, body)

    def create_repo(self, body: dict, _match) -> tuple:
        repo_id = f"{body.get('organization') or 'user'}/{body['name']}"
        if repo_id in self.repos:
            return 409, {}, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
        self.repos[repo_id] = Repo()
        return 200, {}, {"url": f"{self.url}/{repo_id}"}

    def validate_yaml(self, body: dict, _match) -> tuple:
        # The real Hub refuses a local path as `base_model` (transformers#33922); mimic that one rule.
        meta = re.search(r"^base_model:\s*(\S+)\s*$", body.get("content", ""), flags=re.M)
        if meta and _looks_like_local_path(meta.group(1).strip("'\"")):
            message = (
                f'"base_model" with value "{meta.group(1)}" is not valid. Use a model id from https://hf.co/models.'
            )
            return 400, {}, {"errors": [{"message": message}], "warnings": []}
        return 200, {}, {"errors": [], "warnings": []}

    def preupload(self, body: dict, match) -> tuple:
        if match["repo"] not in self.repos:
            return _repo_not_found()
        files = [
            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None} for f in body["files"]
        ]
        return 200, {}, {"files": files}

    def commit(self, lines: list[dict], match) -> tuple:
        repo = self.repos.get(match["repo"])
        if repo is None:
            return _repo_not_found()
        files = dict(repo.snapshot("main")[1])
        for line in lines:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            if line["key"] == "deletedFile":
                files.pop(value["path"], None)
            if line["key"] in ("lfsFile", "deletedFolder", "copyFile"):
                return 400, {}, {"error": f"the fake Hub does not implement {line['key']!r}"}
        oid = hashlib.sha1(json.dumps(lines, sort_keys=True).encode() + str(len(repo.commits)).encode()).hexdigest()
        repo.commits.append((oid, files))
        return 200, {}, {"commitUrl": f"{self.url}/{match['repo']}/commit/{oid}", "commitOid": oid}

    def model_info(self, match) -> tuple:
        repo = self.repos.get(match["repo"])
        if repo is None:
            return _repo_not_found()
        snapshot = repo.snapshot(unquote(match["rev"] or "main"))
        if snapshot is None:
            return 404, {"X-Error-Code": "RevisionNotFound"}, {"error": "Invalid rev id"}
        oid, files = snapshot
        siblings = [{"rfilename": name} for name in sorted(files)]
        return 200, {}, {"id": match["repo"], "sha": oid, "private": False, "siblings": siblings}

    def resolve(self, match, head: bool) -> tuple:
        repo = self.repos.get(match["repo"])
        if repo is None:
            return _repo_not_found()
        snapshot = repo.snapshot(unquote(match["rev"]))
        if snapshot is None:
            return 404, {"X-Error-Code": "RevisionNotFound"}, {"error": "Invalid rev id"}
        oid, files = snapshot
        path = unquote(match["path"])
        if path not in files:
            return 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": oid}, {"error": "Entry not found"}
        data = files[path]
        headers = {"X-Repo-Commit": oid, "ETag": f'"{hashlib.sha1(data).hexdigest()}"', "Content-Length": len(data)}
        return 200, headers, b"" if head else data

    def organization(self, match) -> tuple:
        # Like the real Hub: an overview for an organisation that owns repos, 404 for any other (bitsandbytes, through
        # `kernels`, asks for one at import when transformers >= 5.25 brings `kernels` in).
        org = match["org"]
        models = [repo_id for repo_id in self.repos if repo_id.split("/")[0] == org]
        if not models:
            return 404, {}, {"error": "Not Found"}
        return 200, {}, {"name": org, "fullname": org, "numModels": len(models), "trustedKernelPublisher": False}


def _repo_not_found() -> tuple:
    return 404, {"X-Error-Code": "RepoNotFound"}, {"error": "Repository not found"}


_POST_ROUTES = [
    (re.compile(r"^/api/repos/create$"), FakeHub.create_repo),
    (re.compile(r"^/api/validate-yaml$"), FakeHub.validate_yaml),
    (re.compile(rf"^/api/models/{_REPO}/preupload/{_REV}$"), FakeHub.preupload),
    (re.compile(rf"^/api/models/{_REPO}/commit/{_REV}$"), FakeHub.commit),
]
_RESOLVE = re.compile(rf"^/{_REPO}/resolve/{_REV}/(?P<path>.+)$")
_MODEL_INFO = re.compile(rf"^/api/models/{_REPO}(?:/revision/{_REV})?$")
_ORGANIZATION = re.compile(r"^/api/organizations/(?P<org>[\w.-]+)/overview$")
# Optional lookups the client makes on its own and treats any error as "none" (agent detection registry).
_OPTIONAL = {"/api/agent-harnesses"}


def _handler_for(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output clean; `hub.requests` is the log
            return None

        def _send(self, status: int, headers: dict, body) -> None:
            payload = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            headers = {"Content-Length": len(payload), **headers}
            if not isinstance(body, bytes):
                headers["Content-Type"] = "application/json"
            for key, value in headers.items():
                self.send_header(key, str(value))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        def _route_get(self, head: bool) -> None:
            path = urlparse(self.path).path
            hub.requests.append((self.command, path))
            match = _RESOLVE.match(path)
            if match is not None:
                return self._send(*hub.resolve(match, head=head))
            match = _MODEL_INFO.match(path)
            if match is not None:
                return self._send(*hub.model_info(match))
            match = _ORGANIZATION.match(path)
            if match is not None:
                return self._send(*hub.organization(match))
            if path not in _OPTIONAL:
                hub.unhandled.append((self.command, path))
            self._send(404, {}, {"error": f"fake Hub: no route for {self.command} {path}"})

        def do_HEAD(self) -> None:  # noqa: N802  (http.server's naming)
            self._route_get(head=True)

        def do_GET(self) -> None:  # noqa: N802
            self._route_get(head=False)

        def do_POST(self) -> None:  # noqa: N802
            path = urlparse(self.path).path
            hub.requests.append(("POST", path))
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            for pattern, route in _POST_ROUTES:
                match = pattern.match(path)
                if match is None:
                    continue
                ndjson = self.headers.get("Content-Type", "").startswith("application/x-ndjson")
                body = [json.loads(line) for line in raw.splitlines() if line] if ndjson else json.loads(raw or b"{}")
                return self._send(*route(hub, body, match))
            hub.unhandled.append(("POST", path))
            self._send(404, {}, {"error": f"fake Hub: no route for POST {path}"})

    return Handler


if __name__ == "__main__":
    with FakeHub() as fake_hub:
        print(f"fake Hub listening; use HF_ENDPOINT={fake_hub.url}", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
