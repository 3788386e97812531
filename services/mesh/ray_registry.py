"""The mesh's `Registry` on Ray: a named detached actor, one per Serve application.

Kept apart from `registry.py` so that what runs without Ray (a `LocalMesh` launcher and its workers)
never imports it: `import ray` costs about a second of CPU.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.experimental import internal_kv

from services.mesh.registry import Registry, ServiceEntry

REGISTRY_NAMESPACE = "phasemesh"
# The registry lives on the head node, beside the GCS and Serve's controller (what Ray's own state
# actors do): a worker node lost never takes it along, so losing one costs only its replicas, not
# a registry restart (every entry forgotten until the next heartbeats). A sliver: any head takes it.
ON_HEAD_NODE = {"node:__internal_head__": 0.001}
# Calls the actor serves at once, on threads of its own: every reader's long poll
# (`wait_change`: each router, each token engine's keeper) holds one while it waits, and the
# replicas' heartbeats and claims must never queue behind them.
MAX_CONCURRENT_CALLS = 64


def head_actor(cls: type, name: str, max_concurrency: int, *args: Any) -> Any:
    """`cls(*args)` as a named detached actor on the head node (no CPU, restarted by Ray when its
    process dies), created on first use: its handle."""
    actor: Any = ray.remote(num_cpus=0, max_restarts=-1, resources=ON_HEAD_NODE)(cls)
    return actor.options(  # type: ignore[attr-defined]
        name=name,
        namespace=REGISTRY_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_concurrency=max_concurrency,
    ).remote(*args)


class RayRegistry:
    """The registry actor behind `Registry`'s method names; every call waits at most `timeout_s`."""

    def __init__(self, handle: Any, app_name: str, timeout_s: float = 10.0) -> None:
        self.handle = handle
        self.app_name = app_name
        self.timeout_s = timeout_s

    @classmethod
    def for_app(cls, app_name: str) -> RayRegistry:
        """This application's registry actor, created on first use (no CPU: it keeps a dict), on
        the head node."""
        return cls(head_actor(Registry, f"registry-{app_name}", MAX_CONCURRENT_CALLS), app_name)

    def _call(self, method: str, *args: Any) -> Any:
        return ray.get(getattr(self.handle, method).remote(*args), timeout=self.timeout_s)

    def register(self, entry: ServiceEntry) -> None:
        self._call("register", entry)

    def heartbeat(self, service_id: str) -> bool:
        return bool(self._call("heartbeat", service_id))

    def unregister(self, service_id: str) -> None:
        self._call("unregister", service_id)

    def live(self) -> list[ServiceEntry]:
        return list(self._call("live"))

    def wait_change(self, since: str, timeout_s: float) -> tuple[str, list[ServiceEntry]]:
        """The actor's long poll: answered at a change or at `timeout_s`, so the call waits
        that long plus the usual bound."""
        ref = self.handle.wait_change.remote(since, timeout_s)
        version, entries = ray.get(ref, timeout=timeout_s + self.timeout_s)
        return str(version), list(entries)

    def take_shard_slot(self, entry: ServiceEntry, num_slots: int) -> int:
        return int(self._call("take_shard_slot", entry, num_slots))

    def claim_group(self, token_id: str, num_slots: int) -> list[ServiceEntry] | None:
        group = self._call("claim_group", token_id, num_slots)
        return None if group is None else list(group)

    def claim_peers(self, token_id: str, num_peers: int) -> list[ServiceEntry]:
        return list(self._call("claim_peers", token_id, num_peers))

    def agree_key(self, proposed: str) -> str:
        """`Registry.agree_key`'s rule, kept in the GCS key-value store rather than in the actor:
        the actor restarts (`max_restarts=-1`) with an empty dict, and replicas that asked it
        after that would hold another key than those running. The first put wins (no
        overwrite); the key lasts as long as the cluster."""
        name = f"mesh-key-{self.app_name}"
        internal_kv._internal_kv_put(name, proposed, overwrite=False, namespace=REGISTRY_NAMESPACE)
        return internal_kv._internal_kv_get(name, namespace=REGISTRY_NAMESPACE).decode()

    def shard_census(self) -> tuple[int, int]:
        num_live, num_unclaimed = self._call("shard_census")
        return int(num_live), int(num_unclaimed)
