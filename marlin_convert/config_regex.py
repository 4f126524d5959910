"""Regular expressions that come from a checkpoint's config (GPTQModel ``dynamic`` rules, compressed-tensors ``re:``
targets and ``ignore`` entries): compiled once, and refused where they could run for hours.

Python's ``re`` backtracks, with no time limit. A repeat inside a repeat, such as ``(a+)+$``, takes time exponential
in the name's length on a name that almost matches (a 41-character layer name kept ``inspect`` busy for minutes), and
a chain of wildcards (``.*.*.*.*.*.*x``) time polynomial in it, of the chain's degree. The time comes from choices:
a repeat whose count is not fixed (``*``, ``+``, ``?``, ``{1,16}``) and alternatives (``a|aa``). Refused, with the
config's place named:

- inside a repeat of more than one (``+``, ``*``, ``{2,}``, ``{1,16}``, and fixed counts such as ``{5}`` too), a
  repeat whose count is a choice, or alternatives of more than one character (``(a|b)`` is a character class):
  ``(a+)+``, ``(?:a{1,16}){1,16}``, ``(a|aa)*c``, ``(a|aa){2,16}``; a fixed count inside one is fine
  (``(\\d{2}\\.)+``);
- repeats whose iterations, multiplied through the repeats around them and summed over the pattern, can come to
  more than :data:`MAX_ITERATIONS` (``(?:\\b){100000000}``: a zero-width part repeated a fixed number of times is
  run that many times whatever the name, 10 s a name; ``(?:(?:\\b){60000}){60000}``, minutes); a repeat of more than
  the longest name allows counts as the longest name plus one (``.{0,1000}``: one whose part consumes a character stops
  at the name's end, one whose part matched nothing stops too, once its minimum count is met);
- more than :data:`MAX_RANGES` repeats of more than one whose count is a choice (``*``, ``+``, ``{2,9}``: each one a
  factor of up to the name's length in the time), or more than :data:`MAX_OPTIONALS` optional parts (``?``,
  ``{0,1}``) and alternatives (``(a|bc)``; each one a factor of two or more), in one pattern.

The patterns real producers write (``model\\.layers\\.(\\d+)\\.mlp\\..*``, ``.*\\.18\\..*gate.*``,
``re:.*lm_head``, ``model\\.layers\\.(0|1)\\..*``) pass; a harmless nesting such as ``(\\w+\\.)+mlp`` is refused
too (write it ``[\\w.]+mlp``).
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

#: the most repeats of more than one with a choice of count (``*``, ``+``, ``{2,9}``) one pattern may hold: the
#: worst case grows as the name's length to that power (``.*a.*a.*a.*a!`` took 6.6 s on a 400-character name,
#: ``.*a.*a.*a!`` 0.07 s); GPTQModel's documented rules use up to 3 (``.*\\.18\\..*gate.*``)
MAX_RANGES = 3
#: the most optional parts (``?``, ``{0,1}``, and alternatives ``(a|bc)``: each a factor of two or more) one pattern may
#: hold (``(?:|.)`` 32 times took about a minute per name)
MAX_OPTIONALS = 8
#: the longest module name matched against a config's regex: the refusals above bound a match's time by a power of the
#: name's length (up to MAX_RANGES), and the name comes from the checkpoint too (``.*a.*a.*a!`` took 29 s on one name
#: of 2,000 characters, 6 minutes on 4,000; 0.04 s on 256). The committed producer fixtures' names are at most 52.
MAX_MATCHED_NAME = 256
#: the most iterations the repeats of one pattern can be made to run for one name (see :func:`_iterations`): about
#: 7 ms (a zero-width repeat ran 1e8 iterations in 10.9 s), the order of what MAX_RANGES allows
#: (``.*a.*a.*a!``: 0.04 s on 256 characters); the committed fixtures' and the documented rules need at most 771
MAX_ITERATIONS = 1 << 16

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


def _choices(pattern) -> tuple[int, int]:
    """(repeats of more than one with a choice of count, optional parts) in ``pattern`` (a parsed sequence), at any
    depth. k alternatives count as ceil(log2(k)) optional parts, a factor of k (``(?:|a)`` is ``a?``), plus the
    costliest one's choices (a match tries them one after another: ``.*q_proj.*|.*k_proj.*`` costs what one of them
    does)."""
    ranges = optionals = 0
    for op, av in pattern:
        if op in _REPEATS and av[0] < av[1]:
            if av[1] > 1:
                ranges += 1
            else:
                optionals += 1
        if op is sre_constants.BRANCH:  # k alternatives: a factor of k, as log2(k) optional parts ('(?:|a)' is 'a?'),
            inner = [_choices(alternative) for alternative in av[1]]  # plus the costliest one's own choices
            own = max(1, (len(inner) - 1).bit_length())  # ceil(log2(k))
            ranges, optionals = ranges + max(r for r, _ in inner), optionals + own + max(o for _, o in inner)
            continue
        for child in _children(op, av):
            inner = _choices(child)
            ranges, optionals = ranges + inner[0], optionals + inner[1]
    return ranges, optionals


def _iterations(pattern, enclosing: int) -> int:
    """The most iterations the repeats in ``pattern`` (a parsed sequence) can run for one name of at most
    :data:`MAX_MATCHED_NAME` characters, each repeat counted ``enclosing`` times (the product of the counts of the
    repeats around it). A repeat runs at most its maximum count, and past its minimum count at most one iteration more
    than the name has characters (an iteration that consumed nothing ends it). Alternatives are tried one after
    another: their iterations add up."""
    total = 0
    for op, av in pattern:
        if op in _REPEATS:
            low, high = av[0], av[1]
            count = min(high, max(low, MAX_MATCHED_NAME + 1))
            total += enclosing * count + _iterations(av[2], enclosing * count)
            continue
        for child in _children(op, av):
            total += _iterations(child, enclosing)
    return total


def _choice_inside_a_repeat(pattern, in_repeat: bool) -> bool:
    """Whether ``pattern`` (a parsed sequence) holds, inside a repeat of more than one (``in_repeat``: the enclosing
    one is such a repeat), a repeat whose count is a choice or alternatives."""
    for op, av in pattern:
        if op in _REPEATS:
            low, high = av[0], av[1]
            if in_repeat and low < high:
                return True
            if _choice_inside_a_repeat(av[2], in_repeat or high > 1):
                return True
            continue
        if op is sre_constants.BRANCH and in_repeat:
            return True  # overlapping alternatives ('(a|aa)*c') backtrack exponentially
        for child in _children(op, av):
            if _choice_inside_a_repeat(child, in_repeat):
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
        nested = _choice_inside_a_repeat(parsed, False)
        ranges, optionals = _choices(parsed)
        iterations = _iterations(parsed, 1)
    except RecursionError:
        nested, ranges, optionals, iterations = True, 0, 0, 0
    if nested:
        raise InputError(f"{where}: regular expression {text!r} repeats a repeat or alternatives (such as "
                         f"'(a+)+', '(a{{1,16}}){{1,16}}' or '(a|aa)*'), which can take hours to match a layer name; "
                         f"write it without the nesting")
    if iterations > MAX_ITERATIONS:
        raise InputError(f"{where}: regular expression {text!r} repeats its parts up to {iterations} times (counts such "
                         f"as '{{100000}}', multiplied where repeats nest), more than {MAX_ITERATIONS}: matching it "
                         "against a layer name can take hours, whatever the name")
    if ranges > MAX_RANGES:
        raise InputError(f"{where}: regular expression {text!r} has {ranges} repeats of a chosen count ('*', '+', "
                         f"'{{2,9}}'), more than {MAX_RANGES}: matching it against a layer name can take hours")
    if optionals > MAX_OPTIONALS:
        raise InputError(f"{where}: regular expression {text!r} has {optionals} optional parts or alternatives ('?', "
                         f"'a|bc'), more than {MAX_OPTIONALS}: matching it against a layer name can take hours")
    return pattern


def config_regex_match(pattern: re.Pattern | str, module: str) -> bool:
    """Whether ``pattern`` (checked by :func:`compile_config_regex`) matches the start of ``module``. Raises
    :class:`InputError` for a module name longer than :data:`MAX_MATCHED_NAME`, which is not matched (see there)."""
    return re.match(pattern, _matchable(module)) is not None


def compile_config_search(text: str, where: str) -> re.Pattern:
    """``text`` (an ``extra_config`` key, which AutoRound's and vLLM's readers match with ``re.search``), checked as
    :func:`compile_config_regex` does, as a pattern that :func:`config_regex_match` matches where ``re.search(text)``
    would. ``re.search`` tries every start, a factor of the name's length in the time that :data:`MAX_RANGES` does not
    count (``.*a.*a.*a!`` took 1.4 s a name searched, 0.02 s matched): the form matched counts it as one more repeat,
    ``(?s:.*?)(?:text)``, except where ``text`` starts at the name's start (``^``) or with a ``.*`` (which then
    reaches any start itself), with no ``|`` at its top level. Raises :class:`InputError`."""
    compile_config_regex(text, where)
    flags = re.match(r"(?:\(\?[aiLmsux]+\))*", text).group()  # (global flags, such as (?i): they stay first)
    body = text[len(flags):]
    parsed = sre_parse.parse(text)
    top = list(parsed)
    first = top[0] if top and not any(op is sre_constants.BRANCH for op, _ in top) else (None, None)
    if (first[0] is sre_constants.AT and first[1] is sre_constants.AT_BEGINNING
            and not parsed.state.flags & re.MULTILINE):  # (with (?m) a ^ starts every line)
        return compile_config_regex(text, where)
    if (first[0] in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT)
            and first[1][:2] == (0, sre_constants.MAXREPEAT)
            and list(first[1][2]) == [(sre_constants.ANY, None)]
            and body.startswith(".*?" if first[0] is sre_constants.MIN_REPEAT else ".*")):  # (not (?x)'s " .*")
        lazy = first[0] is sre_constants.MIN_REPEAT
        form = flags + ("(?s:.*?)" if lazy else "(?s:.*)") + body[3 if lazy else 2:]
    else:
        end = "\n" if parsed.state.flags & re.VERBOSE else ""  # (under (?x), a "#" comment ends at a newline only)
        form = f"{flags}(?s:.*?)(?:{body}{end})"
    return compile_config_regex(form, f"{where} (matched anywhere in a module name, as {form!r})")


def _matchable(module: str) -> str:
    """``module``, or :class:`InputError` where its name is longer than :data:`MAX_MATCHED_NAME` (see there)."""
    if len(module) > MAX_MATCHED_NAME:
        raise InputError(f"module '{module[:64]}...' has a name of {len(module)} characters, longer than "
                         f"{MAX_MATCHED_NAME}: not matched against the config's regular expressions (the time grows "
                         "with the name's length)")
    return module
