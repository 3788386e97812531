"""PhaseMesh load generator: trace readers, arrival processes, a streaming OpenAI client, and
SLO/goodput reports. See docs/loadgen.md; the CLI is `python -m loadgen`."""
