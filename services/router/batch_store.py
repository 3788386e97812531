"""The Batch API's state on disk: files, batches and each line's outcome, in one SQLite file.

Everything a batch is lives here, so a router that dies mid-batch loses nothing: a restarted (or
another) router replica claims the batch once its runner's lease runs out and runs the lines that
have no outcome yet. A line's outcome is written in one transaction, once (`record` ignores a
second one), so no line appears twice in the output file, whatever crashed when. A line whose
request was in flight when its runner died runs again: its output is the one recorded.

Several router replicas may share one store (a path on a volume they all mount, or the head
node's store actor: `ray_batch_store.py`): claims are atomic updates, so each batch has one
runner at a time.

Pure storage: no event loop, no HTTP. Calls block briefly (SQLite); the API calls them off the
event loop.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

BATCH_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
WINDOW_S = {"24h": 24 * 3600.0}  # OpenAI accepts only "24h"
MAX_LINE_ERRORS = 20  # per-line errors listed in one refusal; the count says how many in all
FINAL = ("completed", "failed", "cancelled", "expired")
# What is wrong with a line's body for its url ("" when nothing): the API's own request models
# (`batch_api.body_problem`), so a body the endpoint would refuse is refused at upload.
BodyCheck = Callable[[str, dict[str, Any]], str]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, created_at INTEGER NOT NULL,
    content BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL, times TEXT NOT NULL, metadata TEXT, total INTEGER NOT NULL,
    output_file_id TEXT, error_file_id TEXT, owner TEXT, lease_until REAL NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT NOT NULL, url TEXT NOT NULL,
    body TEXT NOT NULL, status_code INTEGER, response TEXT,
    PRIMARY KEY (batch_id, line_no));
"""


class BatchError(ValueError):
    """A request the Batch API refuses: `status` is its HTTP status, `param` what is wrong."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass(frozen=True)
class Line:
    """One request of a batch, not yet answered."""

    line_no: int
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_batch_file(
    content: bytes, body_check: BodyCheck | None = None
) -> list[tuple[str, str, dict[str, Any]]]:
    """The requests of a batch input file (JSONL of `{custom_id, method, url, body}`): each line
    checked (its body by `body_check` too), every error named with its line number (BatchError
    listing them)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatchError(400, f"the file is not UTF-8: {exc}", "file") from None
    out: list[tuple[str, str, dict[str, Any]]] = []
    errors: list[str] = []
    seen: set[str] = set()
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as exc:
            errors.append(f"line {n}: not JSON ({exc.msg})")
            continue
        problem = _line_problem(line, seen)
        if not problem and body_check is not None:
            problem = body_check(line["url"], line["body"])
        if problem:
            errors.append(f"line {n}: {problem}")
            continue
        seen.add(line["custom_id"])
        out.append((line["custom_id"], line["url"], line["body"]))
    if errors:
        shown = "; ".join(errors[:MAX_LINE_ERRORS])
        more = (
            f" (and {len(errors) - MAX_LINE_ERRORS} more)" if len(errors) > MAX_LINE_ERRORS else ""
        )
        raise BatchError(400, f"{len(errors)} invalid line(s): {shown}{more}", "file")
    if not out:
        raise BatchError(400, "the file holds no requests", "file")
    return out


def _line_problem(line: Any, seen: set[str]) -> str:
    if not isinstance(line, dict):
        return "not a JSON object"
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "`custom_id` must be a non-empty string"
    if custom_id in seen:
        return f"`custom_id` {custom_id!r} is not unique"
    if line.get("method") != "POST":
        return "`method` must be POST"
    if line.get("url") not in BATCH_ENDPOINTS:
        return f"`url` must be one of {', '.join(BATCH_ENDPOINTS)}"
    body = line.get("body")
    if not isinstance(body, dict):
        return "`body` must be a JSON object"
    if body.get("stream"):
        return "`body.stream` is not supported in a batch"
    return ""


class BatchStorage(Protocol):
    """What the Batch API and its runner use of a store: `BatchStore` (an SQLite file this process
    opens) or `ray_batch_store.RayBatchStore` (the head node's store actor, for a cluster)."""

    def close(self) -> None: ...
    def create_file(self, purpose: str, filename: str, content: bytes) -> dict[str, Any]: ...
    def get_file(self, file_id: str) -> dict[str, Any]: ...
    def file_content(self, file_id: str) -> bytes: ...
    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None) -> dict[str, Any]: ...  # fmt: skip
    def get_batch(self, batch_id: str) -> dict[str, Any]: ...
    def list_batches(self, after: str | None, limit: int) -> dict[str, Any]: ...
    def cancel(self, batch_id: str) -> dict[str, Any]: ...
    def claim(self, owner: str, lease_s: float, now: float | None = None) -> str | None: ...
    def renew(self, batch_id: str, owner: str, lease_s: float) -> str: ...
    def pending(self, batch_id: str) -> list[Line]: ...
    def record(self, batch_id: str, line_no: int, status_code: int,
               body: dict[str, Any]) -> bool: ...  # fmt: skip
    def finish(self, batch_id: str) -> dict[str, Any]: ...


def _new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class BatchStore:
    """Files, batches and line outcomes in SQLite at `path` (created if missing)."""

    def __init__(self, path: str | Path, body_check: BodyCheck | None = None) -> None:
        self.path, self.body_check = Path(path).expanduser(), body_check
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One connection, used from the API's worker threads one at a time.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                   timeout=30)  # fmt: skip
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # ---- files ----

    def create_file(self, purpose: str, filename: str, content: bytes) -> dict[str, Any]:
        if purpose == "batch":
            parse_batch_file(content, self.body_check)  # refused at upload, each bad line named
        file_id = _new_id("file")
        with self._tx() as db:
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?)",
                       (file_id, purpose, filename, int(time.time()), content))  # fmt: skip
        return self.get_file(file_id)

    def get_file(self, file_id: str) -> dict[str, Any]:
        with self._lock:
            row = self._db.execute(
                "SELECT id, purpose, filename, created_at, length(content) FROM files WHERE id=?",
                (file_id,),
            ).fetchone()
        if row is None:
            raise BatchError(404, f"No file with id `{file_id}`.", "file_id")
        fid, purpose, filename, created_at, size = row
        return {"id": fid, "object": "file", "bytes": size, "created_at": created_at,
                "filename": filename, "purpose": purpose, "status": "processed",
                "expires_at": None}  # fmt: skip

    def file_content(self, file_id: str) -> bytes:
        with self._lock:
            row = self._db.execute("SELECT content FROM files WHERE id=?", (file_id,)).fetchone()
        if row is None:
            raise BatchError(404, f"No file with id `{file_id}`.", "file_id")
        return bytes(row[0])

    # ---- batches ----

    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None) -> dict[str, Any]:  # fmt: skip
        if endpoint not in BATCH_ENDPOINTS:
            raise BatchError(400, f"`endpoint` must be one of {', '.join(BATCH_ENDPOINTS)}",
                             "endpoint")  # fmt: skip
        if completion_window not in WINDOW_S:
            raise BatchError(400, "`completion_window` must be 24h", "completion_window")
        if self.get_file(input_file_id)["purpose"] != "batch":
            raise BatchError(400, "the input file's purpose is not `batch`", "input_file_id")
        lines = parse_batch_file(self.file_content(input_file_id))
        if wrong := [c for c, url, _ in lines if url != endpoint]:
            raise BatchError(400, f"{len(wrong)} line(s) are not for {endpoint} (custom_id "
                             f"{wrong[0]!r}, ...)", "input_file_id")  # fmt: skip
        batch_id, now = _new_id("batch"), time.time()
        with self._tx() as db:
            db.execute(
                "INSERT INTO batches (id, input_file_id, endpoint, completion_window, status,"
                " created_at, expires_at, times, metadata, total) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (batch_id, input_file_id, endpoint, completion_window, "validating", int(now),
                 int(now + WINDOW_S[completion_window]), "{}", json.dumps(metadata),
                 len(lines)),
            )  # fmt: skip
            db.executemany(
                "INSERT INTO lines (batch_id, line_no, custom_id, url, body) VALUES (?,?,?,?,?)",
                [(batch_id, i, c, url, json.dumps(body)) for i, (c, url, body) in enumerate(lines)],
            )
        return self.get_batch(batch_id)

    def get_batch(self, batch_id: str) -> dict[str, Any]:
        with self._lock:
            row = self._db.execute(
                "SELECT id, input_file_id, endpoint, completion_window, status, created_at,"
                " expires_at, times, metadata, total, output_file_id, error_file_id"
                " FROM batches WHERE id=?", (batch_id,),
            ).fetchone()  # fmt: skip
            if row is None:
                raise BatchError(404, f"No batch with id `{batch_id}`.", "batch_id")
            done, failed = self._db.execute(
                "SELECT count(*) FILTER (WHERE status_code BETWEEN 200 AND 299),"
                " count(*) FILTER (WHERE status_code IS NOT NULL AND status_code NOT BETWEEN"
                " 200 AND 299) FROM lines WHERE batch_id=?", (batch_id,),
            ).fetchone()  # fmt: skip
        (bid, input_file_id, endpoint, window, status, created_at, expires_at, times, metadata,
         total, output_file_id, error_file_id) = row  # fmt: skip
        stamps = json.loads(times)
        return {
            "id": bid, "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": window, "status": status,
            "output_file_id": output_file_id, "error_file_id": error_file_id,
            "created_at": created_at, "expires_at": expires_at,
            **{f"{k}_at": stamps.get(k) for k in ("in_progress", "finalizing", "completed",
                                                   "failed", "expired", "cancelling",
                                                   "cancelled")},
            "request_counts": {"total": total, "completed": done, "failed": failed},
            "metadata": json.loads(metadata) if metadata else None,
        }  # fmt: skip

    def list_batches(self, after: str | None, limit: int) -> dict[str, Any]:
        with self._lock:
            start = 0
            if after is not None:
                found = self._db.execute(
                    "SELECT rowid FROM batches WHERE id=?", (after,)
                ).fetchone()
                start = found[0] if found else 0
            ids = [r[0] for r in self._db.execute(
                "SELECT id FROM batches WHERE rowid > ? ORDER BY rowid LIMIT ?", (start, limit + 1)
            )]  # fmt: skip
        data = [self.get_batch(i) for i in ids[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": len(ids) > limit}  # fmt: skip

    def cancel(self, batch_id: str) -> dict[str, Any]:
        """Ask for a batch to stop: its runner finishes the lines in flight and writes what is
        done (status `cancelled`); a batch no runner holds is cancelled at once."""
        self.get_batch(batch_id)  # 404 first
        with self._tx() as db:
            (status,) = db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()
            if status in FINAL or status == "cancelling":
                pass
            else:
                self._stamp(db, batch_id, "cancelling")
        return self.get_batch(batch_id)

    # ---- the runner's side ----

    def claim(self, owner: str, lease_s: float, now: float | None = None) -> str | None:
        """Take the oldest unfinished batch no live runner holds (its lease ran out): its id."""
        now = time.time() if now is None else now
        with self._tx() as db:
            row = db.execute(
                "SELECT id FROM batches WHERE status IN ('validating','in_progress','cancelling')"
                " AND (owner IS NULL OR owner=? OR lease_until < ?) ORDER BY rowid LIMIT 1",
                (owner, now),
            ).fetchone()
            if row is None:
                return None
            db.execute("UPDATE batches SET owner=?, lease_until=? WHERE id=?",
                       (owner, now + lease_s, row[0]))  # fmt: skip
            (status,) = db.execute("SELECT status FROM batches WHERE id=?", (row[0],)).fetchone()
            if status == "validating":
                self._stamp(db, row[0], "in_progress")
        return str(row[0])

    def renew(self, batch_id: str, owner: str, lease_s: float) -> str:
        """Extend this runner's lease; the batch's status (a runner stops on `cancelling`)."""
        with self._tx() as db:
            db.execute("UPDATE batches SET lease_until=? WHERE id=? AND owner=?",
                       (time.time() + lease_s, batch_id, owner))  # fmt: skip
            (status,) = db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()
        return str(status)

    def pending(self, batch_id: str) -> list[Line]:
        with self._lock:
            rows = self._db.execute(
                "SELECT line_no, custom_id, url, body FROM lines WHERE batch_id=?"
                " AND status_code IS NULL ORDER BY line_no", (batch_id,),
            ).fetchall()  # fmt: skip
        return [Line(n, c, u, json.loads(b)) for n, c, u, b in rows]

    def record(self, batch_id: str, line_no: int, status_code: int, body: dict[str, Any]) -> bool:
        """A line's outcome, once: False if it already had one (then nothing changes)."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE lines SET status_code=?, response=? WHERE batch_id=? AND line_no=?"
                " AND status_code IS NULL", (status_code, json.dumps(body), batch_id, line_no),
            )  # fmt: skip
            return cur.rowcount == 1

    def finish(self, batch_id: str) -> dict[str, Any]:
        """Write the output and error files (OpenAI's line format, in input order) and end the
        batch: `completed`, or `cancelled` when it was asked to stop."""
        with self._lock:
            rows = self._db.execute(
                "SELECT line_no, custom_id, status_code, response FROM lines WHERE batch_id=?"
                " AND status_code IS NOT NULL ORDER BY line_no", (batch_id,),
            ).fetchall()  # fmt: skip
        output: list[str] = []
        errors: list[str] = []
        for line_no, custom_id, status_code, response in rows:
            body = json.loads(response)
            ok = 200 <= status_code < 300
            record = {
                "id": f"{batch_id}-{line_no}", "custom_id": custom_id,
                "response": {"status_code": status_code, "request_id": f"{batch_id}-{line_no}",
                             "body": body},
                "error": None if ok else {"code": str(status_code),
                                          "message": body.get("error", {}).get("message", "")},
            }  # fmt: skip
            (output if ok else errors).append(json.dumps(record))
        output_id = self._result_file(batch_id, "output", output)
        error_id = self._result_file(batch_id, "error", errors)
        with self._tx() as db:
            db.execute("UPDATE batches SET output_file_id=?, error_file_id=?, owner=NULL"
                       " WHERE id=?", (output_id, error_id, batch_id))  # fmt: skip
            (status,) = db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()
            self._stamp(db, batch_id, "finalizing")
            self._stamp(db, batch_id, "cancelled" if status == "cancelling" else "completed")
        return self.get_batch(batch_id)

    def _result_file(self, batch_id: str, kind: str, lines: list[str]) -> str | None:
        if not lines:
            return None
        content = ("\n".join(lines) + "\n").encode()
        return str(self.create_file("batch_output", f"{batch_id}_{kind}.jsonl", content)["id"])

    @staticmethod
    def _stamp(db: sqlite3.Connection, batch_id: str, status: str) -> None:
        (times,) = db.execute("SELECT times FROM batches WHERE id=?", (batch_id,)).fetchone()
        stamps = json.loads(times)
        stamps.setdefault(status, int(time.time()))
        db.execute("UPDATE batches SET status=?, times=? WHERE id=?",
                   (status, json.dumps(stamps), batch_id))  # fmt: skip


RAY_STORE_PREFIX = "ray:"


def open_batch_store(spec: str | Path, body_check: BodyCheck | None = None) -> BatchStorage:
    """`batch_store` as the app args give it: `ray:<path>`, the store actor on the Ray head node
    holding the SQLite file `<path>` on the head's disk (every Router of the cluster shares it);
    else a path, an SQLite file this process opens."""
    text = str(spec)
    if text.startswith(RAY_STORE_PREFIX):
        from services.router.ray_batch_store import RayBatchStore  # Ray only where it is asked for

        return RayBatchStore.on_head(text.removeprefix(RAY_STORE_PREFIX), body_check)
    return BatchStore(text, body_check)
