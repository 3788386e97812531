"""Structured outputs: JSON schema, JSON object, regex and choice constraints as token masks."""

from common.structured.grammar import GrammarCompiler, GrammarMatcher, mask_words
from common.structured.masks import apply_masks
from common.structured.spec import parse_structured_output

__all__ = [
    "GrammarCompiler",
    "GrammarMatcher",
    "apply_masks",
    "mask_words",
    "parse_structured_output",
]
