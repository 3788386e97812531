"""Twenty JSON schemas for the structured-output tests: the shapes clients ask for, and the
`logit_bias` that makes a random model's output under them end."""

from collections.abc import Iterable
from typing import Any

from common.tokenizer import Tokenizer

_INT = {"type": "integer"}
_STR = {"type": "string"}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_required": {
        "type": "object",
        "properties": {"name": _STR, "age": _INT},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {"a": _INT, "b": _STR, "c": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    },
    "nested_object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": _INT,
                    "profile": {
                        "type": "object",
                        "properties": {"nick": _STR, "verified": {"type": "boolean"}},
                        "required": ["nick", "verified"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "profile"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },  # fmt: skip
    "array_bounds": {
        "type": "array",
        "items": _INT,
        "minItems": 2,
        "maxItems": 4,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                    "required": ["x", "y"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["points"],
        "additionalProperties": False,
    },
    "string_enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "mixed_enum": {"enum": [1, "two", None, True, 3.5]},
    "const": {
        "type": "object",
        "properties": {"version": {"const": "v1"}, "n": _INT},
        "required": ["version", "n"],
        "additionalProperties": False,
    },
    "integer_range": {
        "type": "object",
        "properties": {"pct": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["pct"],
        "additionalProperties": False,
    },
    "number_range": {
        "type": "array",
        "items": {"type": "number", "exclusiveMinimum": -1.5, "maximum": 2.5},
        "minItems": 1,
        "maxItems": 3,
    },
    "string_pattern": {
        "type": "object",
        "properties": {
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        },
        "required": ["email", "zip"],
        "additionalProperties": False,
    },
    "string_length": {
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 6}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "nullable_anyof": {
        "type": "object",
        "properties": {"maybe": {"anyOf": [_INT, {"type": "null"}]}},
        "required": ["maybe"],
        "additionalProperties": False,
    },
    "type_union": {"type": ["integer", "boolean", "null"]},
    "defs_ref": {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}$"}, "qty": _INT},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"first": {"$ref": "#/$defs/item"}, "second": {"$ref": "#/$defs/item"}},
        "required": ["first"],
        "additionalProperties": False,
    },  # fmt: skip
    "recursive_tree": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": _INT,
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 1},
                },
                "required": ["v", "kids"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },  # fmt: skip
    "free_object": {"type": "object", "properties": {"id": _INT}, "required": ["id"]},
    "boolean_array": {"type": "array", "items": {"type": "boolean"}, "maxItems": 5},
    "tuple_prefix_items": {
        "type": "array",
        "prefixItems": [_STR, _INT, {"type": "boolean"}],
        "items": False,
        "minItems": 3,
    },
    "oneof_shapes": {
        "oneOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                "required": ["kind", "r"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
                "required": ["kind", "side"],
                "additionalProperties": False,
            },
        ]
    },
}


def json_ending_bias(tokenizer: Tokenizer, eos_token_ids: Iterable[int]) -> dict[int, float]:
    """A `logit_bias` (a real API parameter) that makes a random model's JSON end: a random model
    otherwise wanders inside strings and numbers, or nests, for thousands of tokens. Strongest on
    tokens that close a string (inside one, `,` and `}` are text), then on punctuation that closes
    or separates, then on punctuation that opens; EOS as strong as a quote."""
    closing, opening = set('"}],:'), set("{[")
    bias: dict[int, float] = {}
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id])
        if text and set(text) <= closing:
            bias[token_id] = 100.0 if text.startswith('"') else 60.0
        elif text and set(text) <= closing | opening:
            bias[token_id] = 20.0
    return bias | {token_id: 100.0 for token_id in eos_token_ids}
