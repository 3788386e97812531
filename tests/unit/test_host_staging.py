"""A device token engine's crossings to its host shards (Lamina's split), checked on the CPU: a
stand-in staging (a fake for the GPU edge: it copies into fresh host tensors, as the pinned
copies do, and counts) takes the place of `HostStaging`'s device mode. Every q/k/v the shards get
crosses through it once per layer, the replies come back through it once per layer, and the
step's logits are the identity staging's (test_two_batch_runner.py's in-process shards). The
device engine's order is taken too: the copies staged, the local rows' attention (or batch-0's
dense work) queued, then the copies sent."""

from __future__ import annotations

import torch

from common.device import HostStaging, StagedCopy
from tests.unit.test_two_batch_runner import build


class CountingStaging(HostStaging):
    """Stands in for a GPU engine's staging: fresh copies each way, counted."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.on_device = True  # take the device engine's branches
        self.to_host_calls: list[int] = []  # tensors per crossing
        self.to_device_calls = 0

    def stage(self, *tensors: torch.Tensor) -> StagedCopy:
        self.to_host_calls.append(len(tensors))
        return StagedCopy([t.clone() for t in tensors], None)

    def to_host(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        return self.stage(*tensors).wait()

    def host_buffer(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype)  # a row left unwritten shows

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        self.to_device_calls += 1
        return t.clone()


def test_sharded_decode_crosses_once_per_layer_each_way(tiny_model_path) -> None:
    runner, local, sharded, token_ids = build(tiny_model_path)
    plain = runner.run_decode(runner.plan_decode(local, sharded, token_ids, step=1)).logits
    num_layers = len(runner.model.layers)
    for two_batches in (False, True):
        runner, local, sharded, token_ids = build(tiny_model_path)  # the same state, afresh
        staging = runner.staging = CountingStaging()
        plan = runner.plan_decode(local, sharded, token_ids, step=1, two_batches=two_batches)
        logits = runner.run_decode(plan).logits
        torch.testing.assert_close(logits, plain, rtol=1e-4, atol=1e-4)
        # Per layer: one send of q, k, v (both shards' heads sliced from the host copies) and
        # one return of the layer's attention output.
        assert staging.to_host_calls == [3] * num_layers
        assert staging.to_device_calls == num_layers
