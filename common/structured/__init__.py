"""Structured outputs: JSON schema, JSON object, regex and choice constraints as token masks.

`spec` parses a request's constraint (the router's part, torch-free), `grammar` compiles and
matches it (llguidance), `masks` applies its token masks to a step's logits (the engines').
"""
