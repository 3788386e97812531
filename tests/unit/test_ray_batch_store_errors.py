"""A store actor that is restarting or gone answers the Batch API's calls with a 503 and
Retry-After, never a 500 (`services/router/ray_batch_store.py`). The actor's death is stood in
for by a handle whose calls raise what Ray raises then (no Ray cluster needed to say so)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.exceptions import GetTimeoutError, RayActorError

from services.router.api_errors import APIError
from services.router.batch_api import BatchApi
from services.router.batch_store import BatchError
from services.router.ray_batch_store import RayBatchStore


class FailingActorHandleStandIn:
    """Every method's `.remote()` raises `error`, as a dead or unreachable actor's does."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __getattr__(self, name: str) -> Any:
        error = self.error

        class Method:
            def remote(self, *args: Any) -> Any:
                raise error

        return Method()


@pytest.mark.parametrize("error", [RayActorError(), GetTimeoutError("no answer in 30 s")])
def test_a_store_actor_that_cannot_answer_is_a_503_with_retry_after(error: Exception) -> None:
    store = RayBatchStore(FailingActorHandleStandIn(error), timeout_s=0.1)
    with pytest.raises(BatchError) as refused:
        store.get_batch("batch_x")
    assert refused.value.status == 503
    with pytest.raises(APIError) as answered:
        asyncio.run(BatchApi._run(None, store.get_batch, "batch_x"))  # type: ignore[arg-type]
    assert answered.value.status == 503 and answered.value.retry_after_s
