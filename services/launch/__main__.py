"""`python -m services.launch`: start a mesh as local processes and run one demo request.

python -m services.launch --prompt 1 --token 1 --shards 2 [--model PATH] [--no-pin]
"""

from __future__ import annotations

import argparse

from common.protocol import SamplingSpec
from services.launch.local_mesh import LocalMesh, Topology
from services.launch.test_client import MeshTestClient


def main() -> None:
    from common.model.default import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt", type=int, default=1)
    parser.add_argument("--token", type=int, default=1)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--no-pin", action="store_true", help="let the OS place every process")
    args = parser.parse_args()
    topology = Topology(
        str(args.model or default_model_path()), args.prompt, args.token, args.shards,
        pin_decode_groups=not args.no_pin,
    )  # fmt: skip
    mesh = LocalMesh.start(topology)
    try:
        client = MeshTestClient(mesh)
        client.submit("demo", list(range(10, 60)), SamplingSpec(max_tokens=16, temperature=0))
        tokens: list[int] = []
        while True:
            out = client.recv()
            tokens += out.token_ids
            if out.finish_reason:
                break
        print(f"demo request: {len(tokens)} tokens {tokens}, finish: {out.finish_reason}")
        for stats in mesh.stats():
            print(stats)
    finally:
        mesh.close()


if __name__ == "__main__":
    main()
