"""The attention shard (Lamina): `shard.AttentionShard` holds the paged KV of a range of KV heads
and answers per-layer decode attention; `worker` runs it on its UCX and ZeroMQ sockets."""
