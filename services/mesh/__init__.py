"""The mesh on Ray: who is up and where (`registry`), and an engine or shard worker running inside
a Ray Serve replica, registered and heartbeating (`replica`). Nothing here imports `ray.serve`."""
