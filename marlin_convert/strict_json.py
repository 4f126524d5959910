"""JSON as the reference safetensors library reads it: duplicate keys are an error, not "the last one wins".

Used for every JSON file the converter reads (safetensors headers, the index, the configs), so a file cannot
say two things at once. Nesting too deep for the parser is an error too, never a crash.
"""

from __future__ import annotations

import json


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    result: dict = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def loads(text: str | bytes) -> object:
    """Parse ``text`` (bytes must be UTF-8). Raises ValueError (a UnicodeDecodeError is one) for malformed JSON,
    a key repeated within one object, or nesting deeper than the parser can follow."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except RecursionError:
        raise ValueError("nested too deeply") from None
