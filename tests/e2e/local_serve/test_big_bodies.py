"""End to end: no big body freezes the served mesh's streams (issue 49 item 2's acceptance).

Four greedy streams run on `serve run deploy/local.yaml` (the Router replica serving HTTP itself,
its tokenizer pools, the prompt and token engines and the shards in processes of their own) while
an 8 MiB prompt, an 8 MiB chat of one long message, an 8 MiB chat of empty messages and an
8 MiB `/tokenize` body are sent at once: each is a 400, and the streams' largest gap between two
chunks meanwhile stays under 250 ms beyond the machine's own jitter (the bound and its reason:
`Round.stalled`; why a round without a stall settles it: `Gaps`). Before the length bound and
the off-loop tokenizing, the streams stopped for seconds. tests/unit/test_prompt_bounds.py shows
the same with the router in the test's process, where it can also see that no big prompt
reached the tokenizer.
"""

from __future__ import annotations

import pytest

from tests.e2e.serve_process import ServeRun
from tests.unit.test_prompt_bounds import big_bodies, stream_gaps_while_refused

pytestmark = pytest.mark.timeout(300)


def test_streams_keep_flowing_while_8_mib_bodies_are_refused(server: ServeRun) -> None:
    bodies = big_bodies()
    stream_gaps_while_refused(server.base_url, bodies).check(len(bodies))
