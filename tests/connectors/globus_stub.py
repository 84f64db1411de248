"""A local stand-in for the Globus Transfer API (and Globus Auth's token endpoint).

The Globus cloud cannot be reached from the test machines, so the Globus
tests run the real globus-sdk client against this small HTTP server on
127.0.0.1 instead: everything up to the HTTP boundary is the real code path.
It implements only what fxstream's helper uses, with the JSON shapes of the
Transfer API v0.10 (``/submission_id``, ``/transfer``, ``/delete``,
``/task/<id>``, ``/task/<id>/event_list``, ``/task/<id>/cancel``,
``/operation/endpoint/<id>/stat`` and ``/mkdir``) and Auth's
``/v2/oauth2/token`` (client-credentials grant).

"Collections" are local directories: a transfer task copies real bytes from
one directory to the other in a background thread, honouring ``sync_level``
and ``verify_checksum``. A missing source file fails the task with
``FILE_NOT_FOUND`` (as Globus reports it); ``fault_code`` makes every task
keep faulting (what Globus does while, say, a collection denies access),
and ``task_latency_s`` keeps tasks ACTIVE for a while (timeouts, polling).
Every request is recorded (method, path, headers, JSON body) for assertions.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import shutil
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["GlobusTransferStub", "RecordedRequest"]

_SYNC_NAMES = {0: "exists", 1: "size", 2: "mtime", 3: "checksum"}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S+00:00")


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class RecordedRequest:
    """One request the stub received."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any


class _Reply(Exception):
    """Raised inside a handler to answer with an error document."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass
class _Task:
    doc: dict[str, Any]
    request: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)


class GlobusTransferStub:
    """The stand-in server. Use as a context manager; ``url`` is the base URL for both APIs.

    Args:
        collections: Collection id -> the local directory it serves.
        tokens: Bearer tokens the Transfer API accepts.
        clients: Confidential clients (id -> secret) that may mint tokens.
    """

    def __init__(
        self,
        collections: Mapping[str, Path],
        *,
        tokens: set[str] | None = None,
        clients: Mapping[str, str] | None = None,
    ) -> None:
        self.collections = {cid: Path(root) for cid, root in collections.items()}
        self.tokens = set(tokens or ())
        self.clients = dict(clients or {})
        self.task_latency_s = 0.0
        self.fault_code: str | None = None
        self.requests: list[RecordedRequest] = []
        self.tasks: dict[str, _Task] = {}
        self._submissions: dict[str, str] = {}
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        """Base URL (``http://127.0.0.1:<port>/``) for TransferClient and the Auth client."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/"

    def __enter__(self) -> GlobusTransferStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for task in list(self.tasks.values()):
            task.cancelled.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        for worker in self._workers:
            worker.join(timeout=5)

    def requests_to(self, method: str, path_suffix: str) -> list[RecordedRequest]:
        """Recorded requests with this method whose path ends with ``path_suffix``."""
        with self._lock:
            return [r for r in self.requests if r.method == method and r.path.endswith(path_suffix)]

    # -- paths --

    def _resolve(self, collection: str, path: str) -> Path:
        root = self.collections.get(collection)
        if root is None:
            raise _Reply(404, "EndpointNotFound", f"No such collection '{collection}'")
        relative = path[2:] if path.startswith("/~") else path
        candidate = (root / relative.lstrip("/")).resolve()
        if candidate != root.resolve() and root.resolve() not in candidate.parents:
            raise _Reply(
                403, "EndpointPermissionDenied", f"Path not allowed: {path} on {collection}"
            )
        return candidate

    # -- HTTP --

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return  # keep pytest output clean

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def _serve(self, method: str) -> None:
                split = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                content_type = self.headers.get("Content-Type", "")
                body: Any
                if "json" in content_type and raw:
                    body = json.loads(raw)
                elif raw:
                    body = {k: v[0] for k, v in parse_qs(raw.decode()).items()}
                else:
                    body = None
                record = RecordedRequest(
                    method=method,
                    path=split.path,
                    query=parse_qs(split.query),
                    headers={k.lower(): v for k, v in self.headers.items()},
                    body=body,
                )
                with stub._lock:
                    stub.requests.append(record)
                try:
                    status, doc = stub._dispatch(record)
                except _Reply as reply:
                    status, doc = (
                        reply.status,
                        {
                            "code": reply.code,
                            "message": reply.message,
                            "request_id": uuid.uuid4().hex[:9],
                            "resource": split.path,
                        },
                    )
                payload = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        return Handler

    def _dispatch(self, request: RecordedRequest) -> tuple[int, dict[str, Any]]:
        parts = [p for p in request.path.split("/") if p]
        if parts[:3] == ["v2", "oauth2", "token"] and request.method == "POST":
            return self._token(request)
        if not parts or parts[0] != "v0.10":
            raise _Reply(404, "ClientError.NotFound", f"{request.path} is not a resource")
        self._authenticate(request)
        route = parts[1:]
        if route == ["submission_id"] and request.method == "GET":
            return 200, {"value": str(uuid.uuid4())}
        if route == ["transfer"] and request.method == "POST":
            return self._submit(request.body, "transfer")
        if route == ["delete"] and request.method == "POST":
            return self._submit(request.body, "delete")
        if len(route) >= 2 and route[0] == "task":
            task = self._task(route[1])
            if len(route) == 2 and request.method == "GET":
                with self._lock:
                    return 200, dict(task.doc)
            if route[2:] == ["event_list"] and request.method == "GET":
                return 200, self._event_list(task)
            if route[2:] == ["cancel"] and request.method == "POST":
                return 200, self._cancel(task)
        if len(route) == 4 and route[:2] == ["operation", "endpoint"]:
            collection, operation = route[2], route[3]
            if operation == "stat" and request.method == "GET":
                return 200, self._stat(collection, request.query.get("path", [""])[0])
            if operation == "mkdir" and request.method == "POST":
                return 202, self._mkdir(collection, request.body["path"])
        raise _Reply(404, "ClientError.NotFound", f"{request.method} {request.path} not found")

    def _authenticate(self, request: RecordedRequest) -> None:
        header = request.headers.get("authorization", "")
        token = header.removeprefix("Bearer ") if header.startswith("Bearer ") else None
        if token is None:
            raise _Reply(401, "AuthenticationFailed", "No Authorization header found")
        if token not in self.tokens:
            raise _Reply(401, "AuthenticationFailed", "Token is not active")

    def _token(self, request: RecordedRequest) -> tuple[int, dict[str, Any]]:
        header = request.headers.get("authorization", "")
        client_id, _, secret = (
            base64.b64decode(header.removeprefix("Basic ")).decode().partition(":")
            if header.startswith("Basic ")
            else ("", "", "")
        )
        if self.clients.get(client_id) != secret or not secret:
            return 401, {"error": "invalid_client"}
        body = request.body or {}
        if body.get("grant_type") != "client_credentials":
            return 400, {"error": "unsupported_grant_type"}
        token = f"minted-{uuid.uuid4().hex}"
        self.tokens.add(token)
        return 200, {
            "access_token": token,
            "expires_in": 172800,
            "resource_server": "transfer.api.globus.org",
            "scope": body.get("scope", ""),
            "token_type": "Bearer",
            "other_tokens": [],
        }

    # -- operations --

    def _stat(self, collection: str, path: str) -> dict[str, Any]:
        target = self._resolve(collection, path)
        if not target.exists():
            raise _Reply(404, "NotFound", f"Path not found: {path} on {collection}")
        info = target.stat()
        return {
            "DATA_TYPE": "file",
            "name": target.name,
            "type": "dir" if target.is_dir() else "file",
            "size": info.st_size,
            "last_modified": datetime.datetime.fromtimestamp(info.st_mtime, datetime.UTC).strftime(
                "%Y-%m-%d %H:%M:%S+00:00"
            ),
            "permissions": oct(info.st_mode & 0o777)[2:].zfill(4),
            "user": "stub",
            "group": "stub",
            "link_target": None,
        }

    def _mkdir(self, collection: str, path: str) -> dict[str, Any]:
        target = self._resolve(collection, path)
        if target.exists():
            # Globus answers 502 with this code for an existing directory.
            raise _Reply(502, "ExternalError.MkdirFailed.Exists", f"Path already exists: {path}")
        target.mkdir(parents=True)
        return {
            "DATA_TYPE": "mkdir_result",
            "code": "DirectoryCreated",
            "message": "The directory was created successfully",
            "request_id": uuid.uuid4().hex[:9],
            "resource": f"/v0.10/operation/endpoint/{collection}/mkdir",
        }

    def _submit(self, body: dict[str, Any], kind: str) -> tuple[int, dict[str, Any]]:
        if not isinstance(body, dict) or body.get("DATA_TYPE") != kind:
            raise _Reply(400, "ClientError.BadRequest", f"expected DATA_TYPE '{kind}'")
        submission_id = body.get("submission_id")
        if not submission_id:
            raise _Reply(400, "ClientError.BadRequest", "submission_id is required")
        if not body.get("DATA"):
            raise _Reply(
                400, f"ClientError.BadRequest.No{kind.title()}Items", "at least one item needed"
            )
        collections = (
            [body["source_endpoint"], body["destination_endpoint"]]
            if kind == "transfer"
            else [body["endpoint"]]
        )
        for collection in collections:
            if collection not in self.collections:
                raise _Reply(404, "EndpointNotFound", f"No such collection '{collection}'")
        with self._lock:
            duplicate = self._submissions.get(submission_id)
            task_id = duplicate or str(uuid.uuid4())
            if duplicate is None:
                self._submissions[submission_id] = task_id
                self.tasks[task_id] = _Task(doc=self._new_doc(task_id, body, kind), request=body)
        if duplicate is None:
            worker = threading.Thread(target=self._run, args=(self.tasks[task_id], kind))
            worker.daemon = True
            self._workers.append(worker)
            worker.start()
        return 202 if duplicate is None else 200, {
            "DATA_TYPE": f"{kind}_result",
            "code": "Accepted" if duplicate is None else "Duplicate",
            "message": f"The {kind} has been accepted and a task has been created and queued "
            "for execution",
            "request_id": uuid.uuid4().hex[:9],
            "resource": f"/v0.10/{kind}",
            "submission_id": submission_id,
            "task_id": task_id,
            "task_link": {
                "DATA_TYPE": "link",
                "href": f"/v0.10/task/{task_id}?format=json",
                "rel": "related",
                "resource": "task",
                "title": "related task",
            },
        }

    def _new_doc(self, task_id: str, body: dict[str, Any], kind: str) -> dict[str, Any]:
        return {
            "DATA_TYPE": "task",
            "task_id": task_id,
            "type": kind.upper(),
            "status": "ACTIVE",
            "nice_status": "Queued",
            "label": body.get("label"),
            "request_time": _now(),
            "completion_time": None,
            "deadline": body.get("deadline"),
            "source_endpoint_id": body.get("source_endpoint", body.get("endpoint")),
            "destination_endpoint_id": body.get("destination_endpoint"),
            "sync_level": body.get("sync_level"),
            "verify_checksum": bool(body.get("verify_checksum", kind == "transfer")),
            "files": len(body["DATA"]),
            "files_transferred": 0,
            "files_skipped": 0,
            "directories": 0,
            "bytes_transferred": 0,
            "bytes_checksummed": 0,
            "faults": 0,
            "fatal_error": None,
            "is_ok": True,
            "is_paused": False,
            "subtasks_total": len(body["DATA"]),
            "subtasks_pending": len(body["DATA"]),
            "subtasks_succeeded": 0,
            "subtasks_failed": 0,
        }

    def _task(self, task_id: str) -> _Task:
        with self._lock:
            task = self.tasks.get(task_id)
        if task is None:
            raise _Reply(404, "TaskNotFound", f"Task '{task_id}' not found")
        return task

    def _event(self, task: _Task, code: str, description: str, details: str, error: bool) -> None:
        task.events.insert(
            0,
            {
                "DATA_TYPE": "event",
                "code": code,
                "description": description,
                "details": details,
                "is_error": error,
                "time": _now(),
            },
        )

    def _event_list(self, task: _Task) -> dict[str, Any]:
        with self._lock:
            events = list(task.events)
        return {
            "DATA_TYPE": "event_list",
            "DATA": events,
            "length": len(events),
            "limit": 10,
            "offset": 0,
            "total": len(events),
        }

    def _cancel(self, task: _Task) -> dict[str, Any]:
        task.cancelled.set()
        with self._lock:
            if task.doc["status"] == "ACTIVE":
                self._finish(task, "CANCELED", "The task was canceled by the user")
        return {
            "DATA_TYPE": "result",
            "code": "Canceled",
            "message": "The task has been cancelled successfully.",
            "resource": f"/task/{task.doc['task_id']}/cancel",
            "request_id": uuid.uuid4().hex[:9],
        }

    def _finish(self, task: _Task, fatal_code: str | None, description: str = "") -> None:
        """Mark the task done; caller holds the lock."""
        doc = task.doc
        doc["completion_time"] = _now()
        doc["subtasks_pending"] = 0
        if fatal_code is None:
            doc.update(status="SUCCEEDED", nice_status=None, is_ok=None)
            self._event(task, "SUCCEEDED", "succeeded", "", False)
        else:
            doc.update(
                status="FAILED",
                nice_status=None,
                is_ok=None,
                fatal_error={"code": fatal_code, "description": description},
            )
            self._event(task, fatal_code, description.lower(), description, True)

    # -- execution --

    def _run(self, task: _Task, kind: str) -> None:
        with self._lock:
            task.doc["nice_status"] = "OK"
        if task.cancelled.wait(self.task_latency_s):
            return
        while self.fault_code is not None:
            with self._lock:
                if task.cancelled.is_set():
                    return
                task.doc["faults"] += 1
                task.doc["nice_status"] = self.fault_code
                self._event(
                    task,
                    self.fault_code,
                    "error on the destination collection",
                    "Command failed : Path not allowed (stand-in fault)",
                    True,
                )
            if task.cancelled.wait(0.05):
                return
        try:
            if kind == "transfer":
                self._copy_items(task)
            else:
                self._delete_items(task)
        except _Reply as reply:
            with self._lock:
                self._finish(task, reply.code, reply.message)
            return
        with self._lock:
            if task.doc["status"] == "ACTIVE":
                self._finish(task, None)

    def _copy_items(self, task: _Task) -> None:
        body = task.request
        sync_level = body.get("sync_level")
        verify = bool(body.get("verify_checksum", True))
        for item in body["DATA"]:
            source = self._resolve(body["source_endpoint"], item["source_path"])
            destination = self._resolve(body["destination_endpoint"], item["destination_path"])
            if task.cancelled.is_set():
                return
            if not source.exists():
                raise _Reply(404, "FILE_NOT_FOUND", f"No such file or directory: {source.name}")
            if source.is_dir():
                shutil.copytree(source, destination, dirs_exist_ok=True)
                with self._lock:
                    task.doc["directories"] += 1
                continue
            if destination.exists() and self._in_sync(source, destination, sync_level):
                with self._lock:
                    task.doc["files_skipped"] += 1
                continue
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, destination)
            if body.get("preserve_timestamp"):
                shutil.copystat(source, destination)
            size = destination.stat().st_size
            if verify and _md5(source) != _md5(destination):
                raise _Reply(500, "VERIFY_CHECKSUM", f"checksum mismatch on {destination.name}")
            with self._lock:
                task.doc["files_transferred"] += 1
                task.doc["bytes_transferred"] += size
                task.doc["subtasks_succeeded"] += 1
                if verify:
                    task.doc["bytes_checksummed"] += size

    @staticmethod
    def _in_sync(source: Path, destination: Path, sync_level: int | None) -> bool:
        level = _SYNC_NAMES.get(sync_level) if sync_level is not None else None
        if level is None:
            return False
        if level == "exists":
            return True
        same_size = source.stat().st_size == destination.stat().st_size
        if level == "size":
            return same_size
        if level == "mtime":
            return same_size and source.stat().st_mtime <= destination.stat().st_mtime
        return same_size and _md5(source) == _md5(destination)

    def _delete_items(self, task: _Task) -> None:
        body = task.request
        for item in body["DATA"]:
            target = self._resolve(body["endpoint"], item["path"])
            if target.is_dir():
                if not body.get("recursive"):
                    raise _Reply(400, "NOT_A_FILE", f"{item['path']} is a directory")
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
            elif not body.get("ignore_missing"):
                raise _Reply(404, "FILE_NOT_FOUND", f"No such file: {item['path']}")
            with self._lock:
                task.doc["files_transferred"] += 1

    def wait_idle(self, timeout_s: float = 5.0) -> None:
        """Wait until no task is ACTIVE (tests call this before checking files)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if all(t.doc["status"] != "ACTIVE" for t in self.tasks.values()):
                    return
            time.sleep(0.01)
        raise TimeoutError("stub tasks still ACTIVE")
