"""`python -m services.launch`: start a mesh as local processes and run one demo request.

python -m services.launch --prompt 1 --token 1 --shards 2 [--model PATH] [--no-pin]
    [--model-peers N [--decode-lanes L]] [--device auto|cpu|cuda[:N]]

`--model-peers N` gives each token engine N model peer processes (Lamina 4.3's rotation; needs
shards); its decode lanes default to N + 2 (one more lane than replicas, docs/mesh.md).
"""

from __future__ import annotations

import argparse
import asyncio

from common.engine.request import RequestOutput
from common.mesh_options import MeshOptions
from common.sampling_params import SamplingParams
from services.launch.local_mesh import LocalMesh, Topology
from services.router.mesh_client import MeshEngineClient


def main() -> None:
    from common.model.default import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt", type=int, default=1)
    parser.add_argument("--token", type=int, default=1)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--no-pin", action="store_true", help="let the OS place every process")
    parser.add_argument(
        "--model-peers",
        type=int,
        default=0,
        help="model peers per token engine (Lamina 4.3's rotation; needs shards)",
    )
    parser.add_argument("--decode-lanes", type=int, default=None,
                        help="staggered decode lanes per token engine (default: 1, or "
                             "model peers + 2 with peers)")  # fmt: skip
    parser.add_argument("--device", default="auto",
                        help="where prompt and token engines compute: auto, cpu, cuda or cuda:N "
                             "(shards stay on the host)")  # fmt: skip
    args = parser.parse_args()
    lanes = args.decode_lanes or (args.model_peers + 2 if args.model_peers else 1)
    try:
        topology = Topology(
            str(args.model or default_model_path()), args.prompt, args.token, args.shards,
            pin_decode_groups=not args.no_pin,
            options=MeshOptions(
                model_peers=args.model_peers, decode_lanes=lanes, device=args.device
            ),
        )  # fmt: skip
    except ValueError as exc:  # a bad combination: say so, as argparse does
        parser.error(str(exc))
    mesh = LocalMesh.start(topology)
    try:
        client = mesh.engine_client()
        try:
            tokens, last = asyncio.run(demo_request(client))
        finally:
            client.shutdown()
        print(f"demo request: {len(tokens)} tokens {tokens}, finish: {last.finish_reason}")
        for stats in mesh.stats():
            print(stats)
    finally:
        mesh.close()


async def demo_request(client: MeshEngineClient) -> tuple[list[int], RequestOutput]:
    """One greedy request through the router's client: its tokens and its last output."""
    params = SamplingParams(max_tokens=16, temperature=0.0)
    tokens: list[int] = []
    async for out in client.generate("demo", list(range(10, 60)), params):
        if out.error:
            raise RuntimeError(f"the demo request failed: {out.error}")
        tokens += out.new_token_ids
    return tokens, out


if __name__ == "__main__":
    main()
