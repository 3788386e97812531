"""A GPU token engine's crossings to its host shards on the staging stream (common/device.py's
`HostStaging`): copies to pinned memory that the host waits for without waiting for the compute
queued after them, replies ordered before the next kernels by an event, and a runner's sharded
decode steps (one lane, two sub-batches) giving the logits of the same steps staged
synchronously. Collected everywhere, run where CUDA is (bench/device_check.sh)."""

from __future__ import annotations

import pytest
import torch

from common.device import HostStaging, StagedCopy
from common.model.default import default_model_path

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/device_check.sh runs these)"
)


class SyncStaging(HostStaging):
    """The crossing before the staging stream: copies on the engine's stream, the whole stream
    waited for (the reference the overlapped order must equal)."""

    def stage(self, *tensors: torch.Tensor) -> StagedCopy:
        host = [t.to("cpu") for t in tensors]  # synchronous: waits for everything queued
        return StagedCopy(host, None)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)


def test_the_host_waits_for_the_copies_alone() -> None:
    device = torch.device("cuda")
    staging = HostStaging(device)
    x = torch.randn(64, 128, device=device)
    y = x * 2  # the copy must see this, queued before it
    big = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    staged = staging.stage(y)
    for _ in range(20):  # tens of ms of compute queued after the copy
        big = big @ big / 8192
    [host] = staged.wait()
    still_running = not torch.cuda.current_stream(device).query()
    assert host.is_pinned() and torch.equal(host, (x * 2).cpu())
    assert still_running, "wait() waited for the compute queued after the copy"
    back = staging.to_device(host)
    assert torch.equal(back + 0, y)  # the next kernel sees the copied values


@pytest.mark.parametrize("two_batches", [False, True], ids=["one_lane", "two_sub_batches"])
def test_overlapped_staging_gives_the_synchronous_logits(two_batches: bool) -> None:
    from tests.unit.test_two_batch_runner import build

    path, device = default_model_path("tiny"), torch.device("cuda")
    logits = []
    for staging in (SyncStaging(device), HostStaging(device)):
        runner, local, sharded, token_ids = build(path, device)
        runner.staging = staging
        plan = runner.plan_decode(local, sharded, token_ids, step=1, two_batches=two_batches)
        logits.append(runner.run_decode(plan).logits.float().cpu())
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
