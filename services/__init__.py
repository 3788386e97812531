"""The mesh's services, one folder per role; `app.py` wraps them for Ray Serve.

    router/   the OpenAI HTTP surface and the clients that reach the engines
    engine/   prompt / token / mixed engines: scheduling, the model runner, their worker loop
    shard/    attention shards: a slice of KV heads and decode attention
    mesh/     membership on Ray: the registry and a worker inside a Serve replica
    launch/   the mesh as local OS processes, for tests, benches and the demo

Imports run one way: `app` -> roles -> `common`. `docs/structure.md` maps every module.
"""
