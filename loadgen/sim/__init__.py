"""The trace-driven cluster simulator: Splitwise designs, the project's scheduling policies, and a
performance model in place of a GPU. See docs/simulator.md."""
