"""JSON as the reference safetensors library reads it (serde_json, strict RFC 8259): duplicate keys are an error,
not "the last one wins"; ``NaN`` / ``Infinity`` (not JSON), numbers too large for a float (``1e999``, which Python
reads as infinity) and escaped lone surrogates (``"\\ud800"``, no character) are errors, not values Python would
accept and later write back. An integer of more than :data:`MAX_INT_DIGITS` digits is an error naming where it
stands (``layers[0].num_experts``), in place of Python's advice to raise its conversion limit.

Used for every JSON file the converter reads (safetensors headers, the index, the configs, the manifest), so a
file cannot say two things at once. Nesting too deep for the parser is an error too, never a crash.
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


def _not_json(constant: str) -> object:
    raise ValueError(f"{constant} is not a JSON value")


def _finite(text: str) -> float:
    """A JSON number with a fraction or exponent as Python reads it, refused where that is not finite: ``1e999``
    would become infinity, which Python writes back as ``Infinity`` (not JSON) when a config is rewritten."""
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} is too large for a 64-bit float")
    return value


#: the most digits an integer may have: Python's default limit for converting text to int (a longer one is nothing a
#: checkpoint's JSON can mean; the limit stays the same whatever the interpreter is set to)
MAX_INT_DIGITS = 4300


class _TooLarge:
    """An integer of more than :data:`MAX_INT_DIGITS` digits, in place of its value while the text is parsed; found
    by :func:`_place` afterwards, so that the error can say where it stands."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _member(where: str, key: str) -> str:
    if not key.isidentifier():
        return f"{where}[{json.dumps(key)}]"
    return f"{where}.{key}" if where else key


def _place(value: object, wanted: _TooLarge) -> str:
    """Where ``wanted`` stands in ``value``: ``'layers[0].num_experts'`` (a key that is no identifier quoted)."""
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if item is wanted:
            return f"'{where}'" if where else "the document"
        if isinstance(item, dict):
            stack.extend((v, _member(where, k)) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
    return "a value"


def _check_strings(value: object) -> None:
    """Every string (key or value) must be text: a lone surrogate escape decodes to something UTF-8 cannot hold."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"string {item!r} holds a lone surrogate escape, not a character") from None


def loads(text: str | bytes) -> object:
    """Parse ``text`` (bytes must be UTF-8). Raises ValueError (a UnicodeDecodeError is one) for malformed JSON,
    a key repeated within one object, NaN or Infinity, a number too large for a float, a lone surrogate escape, or
    nesting deeper than the parser can follow."""
    from_bytes = isinstance(text, bytes)
    if from_bytes:
        text = text.decode("utf-8")  # strict: a surrogate encoded in the bytes is refused here
    too_large: list[_TooLarge] = []

    def integer(digits: str) -> int | _TooLarge:
        if len(digits.lstrip("-")) <= MAX_INT_DIGITS:
            try:
                return int(digits)
            except ValueError:  # (the interpreter set to a lower limit)
                pass
        too_large.append(_TooLarge(len(digits.lstrip("-"))))
        return too_large[-1]

    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_not_json, parse_float=_finite,
                          parse_int=integer)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if too_large:
        raise ValueError(f"{_place(data, too_large[0])}: a number of {too_large[0].digits} digits, too large to read")
    # decoded UTF-8 holds no surrogate, so one can only come from a \u escape (a str may hold one itself)
    if "\\u" in text or not from_bytes:
        _check_strings(data)
    return data
