"""The mesh as local OS processes, without Ray: `local_mesh.LocalMesh` starts a topology,
`worker_process` is each child's entry point, `core_pinning` places decode groups on cores, and
`test_client` talks to the engines directly (tests, benches). `python -m services.launch` runs a
demo."""
