"""A stand-in for the Hugging Face Hub's HTTP API, on 127.0.0.1, for tests that never touch the network.

It answers the requests the real ``huggingface_hub`` client makes to download a model, the way the Hub
answers them (the client is pointed here with ``HF_ENDPOINT``):

- ``GET /api/models/{repo}[/revision/{rev}]`` (``?blobs=true``: sizes too): the repo's info, with the
  ``config`` and ``gguf`` summaries the Hub derives from config.json and GGUF headers;
- ``GET /api/models/{repo}/tree/{rev}``: the file listing;
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{path}``: a file, with ``X-Repo-Commit``, ``ETag`` and ``Range``;
- ``GET /api/models/{repo}/auth-check``: whether the token may read a gated repo;
- errors with the Hub's ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``,
  ``GatedRepo``), which the client turns into its own exception classes.

A test can cut a file's first download after some bytes (``cut``), gate a repo behind a token, and read
every request made (``requests``).
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

GOOD_TOKEN = "hf_standin_good_token"


@dataclass
class _Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> path -> content
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha
    gated: bool = False
    sizes: dict[str, int] = field(default_factory=dict)  # sizes listed instead of the real ones (disk checks)


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _gguf_summary(data: bytes) -> dict | None:
    """What the Hub lists of a GGUF repo: its architecture, from the first file's header (the
    metadata's first pair, as llama.cpp's and gguf-py's writers put it)."""
    if data[:4] != b"GGUF":
        return None
    pos = 4 + 4 + 8 + 8  # magic, version, tensor count, metadata count
    (n,) = struct.unpack_from("<Q", data, pos)
    key = data[pos + 8 : pos + 8 + n].decode()
    pos += 8 + n
    (vtype,) = struct.unpack_from("<I", data, pos)
    if key != "general.architecture" or vtype != 8:  # 8: a string
        return None
    (n,) = struct.unpack_from("<Q", data, pos + 4)
    return {"architecture": data[pos + 12 : pos + 12 + n].decode(), "total": 0}


class HubStandIn:
    def __init__(self) -> None:
        self.repos: dict[str, _Repo] = {}
        self.requests: list[dict] = []  # method, path, range, authorization
        self.cut: dict[str, int] = {}  # file path -> bytes sent before the connection is dropped (once)
        self._server: ThreadingHTTPServer | None = None

    # ------------------------------------------------------------------ content

    def add_commit(self, repo_id: str, files: dict[str, bytes | Path], ref: str = "main", gated: bool = False) -> str:
        """A commit holding ``files`` (repo path -> bytes or a file to read), pointed to by ``ref``; its sha."""
        repo = self.repos.setdefault(repo_id, _Repo())
        repo.gated = repo.gated or gated
        content = {p: (v.read_bytes() if isinstance(v, Path) else v) for p, v in files.items()}
        sha = _sha1(json.dumps(sorted((p, _sha1(b)) for p, b in content.items())).encode() + repo_id.encode())
        repo.commits[sha] = content
        repo.refs[ref] = sha
        return sha

    def add_folder(self, repo_id: str, folder: Path, ref: str = "main", gated: bool = False) -> str:
        files = {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.add_commit(repo_id, files, ref=ref, gated=gated)

    # ------------------------------------------------------------------ server

    def start(self) -> str:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                standin._answer(self, head=False)

            def do_HEAD(self) -> None:
                standin._answer(self, head=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self.endpoint

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ------------------------------------------------------------------ answers

    def _answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        query = parse_qs(url.query)
        self.requests.append(
            {
                "method": h.command,
                "path": path,
                "range": h.headers.get("Range"),
                "authorization": h.headers.get("Authorization"),
            }
        )
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id, rest = "/".join(parts[2:4]), parts[4:]
            repo = self.repos.get(repo_id)
            if repo is None:
                return self._error(h, 404, "RepoNotFound", f"Repository not found: {repo_id}")
            if rest == ["auth-check"]:
                return self._gate(h, repo_id, repo) or self._json(h, {})
            if rest[:1] == ["tree"] and len(rest) >= 2:
                sha = self._commit(repo, rest[1])
                if sha is None:
                    return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rest[1]}")
                return self._json(h, self._tree(repo, sha))
            rev = rest[1] if rest[:1] == ["revision"] and len(rest) >= 2 else "main"
            sha = self._commit(repo, rev)
            if sha is None:
                return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return self._json(
                h, self._info(repo_id, repo, sha, blobs=[v.lower() for v in query.get("blobs", [])] == ["true"])
            )
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, rev, file = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            repo = self.repos.get(repo_id)
            if repo is None:
                return self._error(h, 404, "RepoNotFound", f"Repository not found: {repo_id}")
            sha = self._commit(repo, rev)
            if sha is None:
                return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
            if self._gate(h, repo_id, repo):
                return None
            data = repo.commits[sha].get(file)
            if data is None:
                return self._error(h, 404, "EntryNotFound", f"{file} does not exist on {rev}")
            return self._file(h, head, sha, file, data)
        return self._error(h, 404, None, "Not Found")

    def _gate(self, h: BaseHTTPRequestHandler, repo_id: str, repo: _Repo) -> bool:
        """A gated repo's files answer 401 without a token and 403 with one that has no access."""
        if not repo.gated:
            return False
        auth = h.headers.get("Authorization")
        if auth is None:
            self._error(
                h,
                401,
                "GatedRepo",
                f"Access to model {repo_id} is restricted. You must have access to it and be "
                "authenticated to access it. Please log in.",
            )
        elif auth != f"Bearer {GOOD_TOKEN}":
            self._error(
                h,
                403,
                "GatedRepo",
                f"Access to model {repo_id} is restricted and you are not in the authorized list. "
                f"Visit {self.endpoint}/{repo_id} to ask for access.",
            )
        else:
            return False
        return True

    @staticmethod
    def _commit(repo: _Repo, rev: str) -> str | None:
        return rev if rev in repo.commits else repo.refs.get(rev)

    def _info(self, repo_id: str, repo: _Repo, sha: str, blobs: bool) -> dict:
        files = repo.commits[sha]
        siblings = []
        for p, data in sorted(files.items()):
            s: dict = {"rfilename": p}
            if blobs:
                size = repo.sizes.get(p, len(data))
                s |= {"size": size, "blobId": _sha1(data)}
                if p.endswith((".safetensors", ".gguf")):
                    s["lfs"] = {"size": size, "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
            siblings.append(s)
        info: dict = {
            "_id": _sha1(repo_id.encode())[:24],
            "id": repo_id,
            "modelId": repo_id,
            "sha": sha,
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "tags": [],
            "siblings": siblings,
        }
        if "config.json" in files:
            config = json.loads(files["config.json"])
            info["config"] = {k: config[k] for k in ("architectures", "model_type") if k in config}
        ggufs = [p for p in sorted(files) if p.endswith(".gguf")]
        if ggufs and (summary := _gguf_summary(files[ggufs[0]])):
            info["gguf"] = summary
        return info

    @staticmethod
    def _tree(repo: _Repo, sha: str) -> list[dict]:
        out = []
        for p, data in sorted(repo.commits[sha].items()):
            entry: dict = {"type": "file", "oid": _sha1(data), "size": len(data), "path": p}
            if p.endswith((".safetensors", ".gguf")):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            out.append(entry)
        return out

    def _file(self, h: BaseHTTPRequestHandler, head: bool, sha: str, file: str, data: bytes) -> None:
        start = 0
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes=") and not head:
            start = int(rng[len("bytes=") :].split("-")[0] or 0)
        body = data[start:]
        h.send_response(206 if start else 200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(data) if head else len(body)))
        h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        h.send_header("X-Repo-Commit", sha)
        h.send_header("Accept-Ranges", "bytes")
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if head:
            return
        cut = self.cut.pop(file, None)
        if cut is not None and cut < len(body):
            h.wfile.write(body[:cut])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)  # the network drops mid-file
            return
        h.wfile.write(body)

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, obj) -> None:
        body = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    @staticmethod
    def _error(h: BaseHTTPRequestHandler, status: int, code: str | None, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)
