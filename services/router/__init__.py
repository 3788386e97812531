"""The router: OpenAI-compatible HTTP (`server.Router`), request models and error bodies
(`openai_api`), and the `EngineClient`s it generates with: in-process (`engine_client`) or over
the mesh (`mesh_client`, placing requests with `cluster_scheduler`). Root spans and the
client-facing TTFT/TBT metrics are in `telemetry`."""
