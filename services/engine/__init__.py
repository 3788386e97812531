"""The engine: one class (`engine.Engine`) in the prompt, token or mixed role (Splitwise).

`runner` ships prefill KV and sends decode attention to shards (Lamina); `admission` decides when
a handed-off request may start decoding; `telemetry` records its spans and metrics; `worker` puts
it on ZeroMQ and UCX sockets and runs its loop."""
