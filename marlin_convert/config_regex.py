"""Regular expressions that come from a checkpoint's config (GPTQModel ``dynamic`` rules, compressed-tensors ``re:``
targets and ``ignore`` entries): compiled once, and refused where they could run for hours.

Python's ``re`` backtracks, with no time limit. A repeat inside a repeat, such as ``(a+)+$``, takes time exponential
in the name's length on a name that almost matches (a 41-character layer name kept ``inspect`` busy for minutes), and
a chain of wildcards (``.*.*.*.*.*.*x``) time polynomial in it, of the chain's degree. Refused, with the config's place
named:

- a repeat of more than one (``+``, ``*``, ``{2,}``, ``{5}``) anywhere inside another repeat of more than one, where
  either has no upper bound or one above :data:`MAX_BOUND` (``(a{1,50}){1,50}``);
- alternatives (``|``, of more than one character: ``(a|b)`` is a character class) inside a repeat of more than one
  (``(a|aa)*c``: overlapping alternatives backtrack exponentially too);
- more than :data:`MAX_UNBOUNDED` unbounded repeats in one pattern.

The patterns real producers write (``model\\.layers\\.(\\d+)\\.mlp\\..*``, ``.*\\.18\\..*gate.*``,
``re:.*lm_head``) pass; a harmless nesting such as ``(\\w+\\.)+mlp`` is refused too (write it ``[\\w.]+mlp``).
"""

from __future__ import annotations

import re

try:  # Python 3.11+
    from re import _constants as sre_constants
    from re import _parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

from .errors import InputError

#: a repeat bounded above this counts as unbounded for the nesting rule
MAX_BOUND = 16
#: the most unbounded repeats one pattern may hold
MAX_UNBOUNDED = 4

_REPEATS = {sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT}
if hasattr(sre_constants, "POSSESSIVE_REPEAT"):
    _REPEATS.add(sre_constants.POSSESSIVE_REPEAT)


def _children(op, av) -> list:
    """The sub-patterns of one parsed node (groups, alternatives, lookarounds, conditionals)."""
    if op in _REPEATS:
        return [av[2]]
    if op is sre_constants.SUBPATTERN:
        return [av[-1]]
    if op is sre_constants.BRANCH:
        return list(av[1])
    if op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT):
        return [av[1]]
    if op is sre_constants.GROUPREF_EXISTS:
        return [p for p in av[1:] if p is not None]
    if hasattr(sre_constants, "ATOMIC_GROUP") and op is sre_constants.ATOMIC_GROUP:
        return [av]
    return []


def _unbounded(high) -> bool:
    return high is sre_constants.MAXREPEAT or high == sre_constants.MAXREPEAT


def _count_unbounded(pattern) -> int:
    """The number of unbounded repeats in ``pattern`` (a parsed sequence), at any depth."""
    count = 0
    for op, av in pattern:
        if op in _REPEATS and _unbounded(av[1]):
            count += 1
        for child in _children(op, av):
            count += _count_unbounded(child)
    return count


def _nested_repeat(pattern, outer_unbounded: bool | None) -> bool:
    """Whether ``pattern`` (a parsed sequence) holds a repeat of more than one nested in another, one of them
    unbounded (or bounded above MAX_BOUND). ``outer_unbounded``: None outside any repeat, else whether the enclosing
    repeat counts as unbounded."""
    for op, av in pattern:
        if op in _REPEATS:
            high = av[1]
            if high > 1:
                unbounded = _unbounded(high) or high > MAX_BOUND
                if outer_unbounded is not None and (outer_unbounded or unbounded):
                    return True
                if _nested_repeat(av[2], unbounded):
                    return True
                continue
        if op is sre_constants.BRANCH and outer_unbounded:
            # alternatives under a repeat: overlapping ones ('(a|aa)*c') backtrack exponentially too
            return True
        for child in _children(op, av):
            if _nested_repeat(child, outer_unbounded):
                return True
    return False


def compile_config_regex(text: str, where: str) -> re.Pattern:
    """Compile ``text`` (a regex from ``where``, a config's file and entry) or raise :class:`InputError`: not a
    valid regular expression, or one with a nested repeat (see the module docstring)."""
    try:
        pattern = re.compile(text)
    except (re.error, RecursionError, OverflowError) as exc:
        raise InputError(f"{where}: not a valid regular expression: {exc}") from exc
    try:
        parsed = sre_parse.parse(text)
        nested = _nested_repeat(parsed, None)
        unbounded = _count_unbounded(parsed)
    except RecursionError:
        nested, unbounded = True, 0
    if nested:
        raise InputError(f"{where}: regular expression {text!r} repeats a repeat or alternatives (such as "
                         f"'(a+)+' or '(a|aa)*'), which can take hours to match a layer name; write it without the "
                         f"nesting")
    if unbounded > MAX_UNBOUNDED:
        raise InputError(f"{where}: regular expression {text!r} has {unbounded} unbounded repeats ('*', '+'), more "
                         f"than {MAX_UNBOUNDED}: matching it against a layer name can take hours")
    return pattern
