"""The mesh as local OS processes, without Ray: `local_mesh.LocalMesh` starts a topology (and
builds the router's client over it, `engine_client`), `worker_process` is each child's entry
point, `core_pinning` places decode groups on cores. `python -m services.launch` runs a demo."""
