"""The Batch API's store for a cluster: one `BatchStore` (SQLite on the head node's disk) held by
a named Ray actor pinned to the head node, which every Router replica on every node reaches.

`batch_store: "ray:<path>"` in the app args chooses it (`<path>` on the head's disk); a plain path
is an SQLite file each Router opens itself (`BatchStore`; one node, or a shared volume). Every
Router naming the same path gets the same actor (named by the path), so all of them see every file
and batch, and a batch's lease and its lines' outcomes are decided in one place, as with the file.

Kept apart from `batch_store.py` so that a router without it never imports Ray.

Faults:
- a Router dies mid-batch: its lease runs out in the actor's SQLite and a Router on any node claims
  the batch; each line's outcome is written once (`BatchStore.record`), so none is lost or twice.
- the actor's process dies: Ray restarts it on the head (`max_restarts=-1`) and it reopens the
  SQLite file, so nothing committed is lost; a call in flight fails (an API call answers 503
  with Retry-After; a runner's batch loop logs it, claims its batch again at its next poll and
  runs the lines that have no outcome yet). Calls wait at most `timeout_s`.
- the head node dies: the Ray cluster goes with it (its GCS is there); the SQLite file stays on
  the head's disk, and a cluster started again on that head with the same `batch_store` resumes
  every unfinished batch. A head whose disk is lost loses the batches: put `<path>` on a volume
  that outlives it.
"""

from __future__ import annotations

import os
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from services.mesh.ray_registry import head_actor
from services.router.batch_store import BatchError, BatchStore, BodyCheck, Line

# Calls the actor serves at once: every Router's API calls and its runner's lease renewals; the
# store's own lock orders them around SQLite.
MAX_CONCURRENT_CALLS = 16


class RayBatchStore:
    """`BatchStore`'s methods, each a call to the head's store actor."""

    def __init__(self, handle: Any, timeout_s: float = 30.0) -> None:
        self.handle, self.timeout_s = handle, timeout_s

    @classmethod
    def on_head(cls, path: str, body_check: BodyCheck | None = None) -> RayBatchStore:
        """The store actor for `path` (on the head's disk), created on first use."""
        name = f"batch-store:{os.path.normpath(path)}"
        return cls(head_actor(BatchStore, name, MAX_CONCURRENT_CALLS, path, body_check))

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self.handle, method).remote(*args), timeout=self.timeout_s)
        except RayTaskError as exc:
            if isinstance(exc.cause, BatchError):
                raise exc.cause from None  # the API's 4xx, as the file store raises it
            raise
        except (RayActorError, GetTimeoutError) as exc:  # restarting, or its node is busy
            raise BatchError(
                503, f"the batch store is unavailable, retry shortly ({exc})"
            ) from None

    def close(self) -> None:
        """The actor stays: other Routers use it."""

    def create_file(self, purpose: str, filename: str, content: bytes) -> dict[str, Any]:
        return dict(self._call("create_file", purpose, filename, content))

    def get_file(self, file_id: str) -> dict[str, Any]:
        return dict(self._call("get_file", file_id))

    def file_content(self, file_id: str) -> bytes:
        return bytes(self._call("file_content", file_id))

    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None) -> dict[str, Any]:  # fmt: skip
        return dict(self._call("create_batch", input_file_id, endpoint, completion_window,
                               metadata))  # fmt: skip

    def get_batch(self, batch_id: str) -> dict[str, Any]:
        return dict(self._call("get_batch", batch_id))

    def list_batches(self, after: str | None, limit: int) -> dict[str, Any]:
        return dict(self._call("list_batches", after, limit))

    def cancel(self, batch_id: str) -> dict[str, Any]:
        return dict(self._call("cancel", batch_id))

    def claim(self, owner: str, lease_s: float, now: float | None = None) -> str | None:
        claimed = self._call("claim", owner, lease_s, now)
        return None if claimed is None else str(claimed)

    def renew(self, batch_id: str, owner: str, lease_s: float) -> str:
        return str(self._call("renew", batch_id, owner, lease_s))

    def pending(self, batch_id: str) -> list[Line]:
        return list(self._call("pending", batch_id))

    def record(self, batch_id: str, line_no: int, status_code: int, body: dict[str, Any]) -> bool:
        return bool(self._call("record", batch_id, line_no, status_code, body))

    def finish(self, batch_id: str) -> dict[str, Any]:
        return dict(self._call("finish", batch_id))
