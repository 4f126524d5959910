"""Reading a GPTQ checkpoint: its config, its shards, and one checked plan per quantized linear.

Everything here reads; nothing writes. :func:`open_checkpoint` parses the configs (every value type-checked)
and every shard header and checks the index; :func:`plan_layers` finds each quantized linear (prefix ``P`` with
``P.qweight``), resolves its settings once (the config's defaults overridden by the first matching GPTQModel
``dynamic`` rule), checks the shapes and dtypes of its tensors against each other and those settings, reads
the small tensors (``qzeros``, ``g_idx``) to decide the zero format and act-order, and records the result as
one :class:`~marlin_convert.spec.QuantSpec` per layer, plus whether the layer can become Marlin and, if not,
why. All of that happens before a single byte is written.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import ClassVar

import numpy as np

from . import layout, strict_json
from .config_regex import MAX_MATCHED_NAME, compile_config_regex, compile_config_search, config_regex_match
from .errors import InputError, SettingsMismatchError
from .fileio import dead_link, outside_link, read_inside
from .safetensors_io import DTYPE_NAMES, HeldShards, SafetensorsFile, TensorInfo, read_header, read_tensor
from .spec import QuantSpec

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
QUANTIZE_CONFIG_FILE = "quantize_config.json"

#: bit widths GPTQ writes; Marlin has forms for 4 and 8
GPTQ_BITS = (2, 3, 4, 8)
MARLIN_BITS = (4, 8)
#: Marlin has a form for these group sizes (plus any group size >= K, which is channelwise)
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
SCALE_DTYPES = ("F16", "BF16", "F32")
#: a GPTQ linear's own tensors (``P.<kind>``; g_idx where stored): what a layer kept in GPTQ form keeps
LAYER_KINDS = ("qweight", "scales", "qzeros", "g_idx")
#: values of the config's format keys (``checkpoint_format``, GPTQModel's ``format``) and the zero format each means
ZERO_FORMAT_OF_LABEL = {"gptq": "v1", "gptq_v2": "v2"}
#: labels that mean the directory is already (partly) converted
MARLIN_LABELS = ("marlin", "marlin-partial")
#: the per-module settings a ``dynamic`` rule may override, and their JSON types
RULE_KEYS = {"bits": int, "group_size": int, "sym": bool, "desc_act": bool}
#: AutoRound's ``extra_config``: the bits that mean "not quantized" (the module keeps its plain weight)
UNQUANTIZED_BITS = 16
#: the characters that make an ``extra_config`` key a regular expression for vLLM's AutoRound reader (a key without
#: any is a module name to it; AutoRound's own reader takes every key that names no module as a regex)
EXTRA_REGEX_CHARS = frozenset("*+?^$()[]{}|\\")


def symmetric_stored_zero(bits: int, zero_format: str) -> int:
    """The value a symmetric layer stores in every qzeros slot: 2^(b-1) - 1 in v1 (7 / 127), 2^(b-1) in v2."""
    return (1 << (bits - 1)) - (1 if zero_format == "v1" else 0)


# ----------------------------------------------------------------------------------------------- the config


def _json_kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float" if value.is_integer() else "a non-integer number"
    if isinstance(value, str):
        return "a string"
    return "null" if value is None else ("a list" if isinstance(value, list) else "an object")


def typed(value, kind: type, key: str, where: str):
    """``value`` if it is a JSON ``kind`` (bool is not an int; 4.0 is not an int), else InputError naming both."""
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        wanted = {bool: "a JSON boolean (true or false)", int: "a JSON integer", str: "a JSON string",
                  dict: "a JSON object", list: "a JSON list"}[kind]
        found = "null" if value is None else f"{_json_kind(value)} {json.dumps(value)}"
        raise InputError(f"{where}: '{key}' must be {wanted}, found {found}")
    return value


def _check_bits(bits: int, key: str, where: str, also: str = "") -> int:
    if bits not in GPTQ_BITS:
        raise InputError(f"{where}: '{key}' is {bits}; GPTQ has {', '.join(map(str, GPTQ_BITS))} bits{also}")
    return bits


def _check_group_size(group_size: int, key: str, where: str) -> int:
    if group_size != -1 and group_size <= 0:
        raise InputError(f"{where}: '{key}' is {group_size}; expected -1 (channelwise) or a positive group size")
    return group_size


@dataclass(frozen=True)
class DynamicRule:
    """One GPTQModel ``dynamic`` entry. ``key`` as written: ``+:REGEX`` or a bare ``REGEX`` overrides settings of
    the modules it matches, ``-:REGEX`` says they are not quantized. Matching is ``re.match`` on the module
    name (anchored at the start, not at the end), as GPTQModel and vLLM do; the first matching rule wins."""

    key: str
    pattern: re.Pattern
    excluded: bool
    overrides: dict  # a subset of RULE_KEYS, type-checked
    where: str  # the config file it came from
    kind: ClassVar[str] = "dynamic rule"

    def matches(self, module: str) -> bool:
        return config_regex_match(self.pattern, module)


def _config_entries(value, key: str, kind: str, where: str) -> list[tuple[str, dict, str]]:
    """The entries of a config's per-module object ``key`` (``dynamic``, ``extra_config``; null: none), each as (its
    key, its settings object, where it is for messages). Raises :class:`InputError` for a value that is no object."""
    if value is None:
        return []
    typed(value, dict, key, where)
    entries = []
    for name, body in value.items():
        entry_where = f"{where}: {kind} {json.dumps(name)}"
        entries.append((name, typed(body, dict, "value", entry_where), entry_where))
    return entries


def parse_dynamic(value, where: str) -> tuple[DynamicRule, ...]:
    """A ``dynamic`` object's rules, in order, each regex compiled and checked. Raises :class:`InputError`."""
    rules = []
    for key, body, rule_where in _config_entries(value, "dynamic", DynamicRule.kind, where):
        excluded = key.startswith("-:")
        regex = key[2:] if key.startswith(("-:", "+:")) else key
        pattern = compile_config_regex(regex, rule_where)
        overrides = {name: typed(body[name], kind, name, rule_where) for name, kind in RULE_KEYS.items()
                     if name in body}
        if "bits" in overrides:
            _check_bits(overrides["bits"], "bits", rule_where)
        if "group_size" in overrides:
            _check_group_size(overrides["group_size"], "group_size", rule_where)
        rules.append(DynamicRule(key, pattern, excluded, overrides, where))
    return tuple(rules)


@dataclass(frozen=True)
class ExtraEntry:
    """One entry of AutoRound's ``extra_config`` (``quantization_config.extra_config``: key -> settings). A key is
    a module's full name (``model.layers.0.self_attn.k_proj``), or a regular expression (AutoRound writes its
    ``regex_config`` keys so: ``.*mlp\\.gate.*``) matched with ``re.search``, as AutoRound's and vLLM's readers match
    it; a module's own name wins over any regex. ``overrides``: the ``bits`` (16: not quantized), ``group_size`` and
    ``sym`` it states, type-checked; every other key is checked for what Marlin cannot serve by
    :func:`parse_extra_config` and otherwise left as written."""

    key: str
    pattern: re.Pattern
    is_regex: bool  # the key holds one of EXTRA_REGEX_CHARS (else it is a module name, compiled to find misreadings)
    overrides: dict
    where: str
    kind: ClassVar[str] = "extra_config entry"

    @property
    def excluded(self) -> bool:
        return self.overrides.get("bits") == UNQUANTIZED_BITS

    def matches(self, module: str) -> bool:
        return self.key == module or config_regex_match(self.pattern, module)


def parse_extra_config(value, where: str, default_bits) -> tuple[ExtraEntry, ...]:
    """An ``extra_config`` object's entries, in order, each checked (``default_bits``: the config's ``bits``, which an
    entry without its own inherits). Raises :class:`InputError` naming ``where``, the key ``extra_config``, the entry
    and the value for what marlin-convert cannot serve: bits other than GPTQ's or 16 (not quantized), quantized
    activations (``act_bits`` below 16), weights of a ``data_type`` other than ``int``, GGUF-style double-quantized
    scales (``super_bits``, ``super_group_size``), rotated weights (``rotation_config``)."""
    entries = []
    for key, body, entry_where in _config_entries(value, "extra_config", ExtraEntry.kind, where):
        overrides = {name: typed(body[name], kind, name, entry_where) for name, kind in RULE_KEYS.items()
                     if name in body and name != "desc_act"}
        bits = overrides.get("bits", default_bits)
        if "bits" in overrides and bits != UNQUANTIZED_BITS:
            _check_bits(bits, "bits", entry_where, also=f", or {UNQUANTIZED_BITS} for a module left unquantized")
        if "group_size" in overrides:
            _check_group_size(overrides["group_size"], "group_size", entry_where)
        quantized = bits != UNQUANTIZED_BITS
        for _, problem in _unservable(body, quantized):
            raise InputError(f"{entry_where}: {problem}", hint=EXTRA_CONFIG_HINT)
        is_regex = any(char in EXTRA_REGEX_CHARS for char in key)
        entries.append(ExtraEntry(key, compile_config_search(key, entry_where), is_regex, overrides, where))
    return tuple(entries)


#: the hint of every refusal of an AutoRound setting Marlin cannot serve
EXTRA_CONFIG_HINT = ("marlin-convert converts weight-only integer GPTQ layers (data_type int, act_bits 16, bits 4 or "
                     "8); quantize the module so, or leave it unquantized (bits 16)")


def _unservable(settings: dict, quantized: bool) -> list[tuple[str, str]]:
    """What AutoRound ``settings`` (an ``extra_config`` entry, or the config's own keys) state that a Marlin layer
    cannot hold, as (key, one line) each: quantized activations, a ``data_type`` other than ``int`` for quantized
    weights, GGUF-style double quantization, rotated weights. Absent or null keys state nothing."""
    problems = []
    act_bits = settings.get("act_bits")
    if act_bits is not None and (not isinstance(act_bits, int) or isinstance(act_bits, bool) or act_bits < 16):
        problems.append(("act_bits", f"act_bits is {json.dumps(act_bits)}: quantized activations have no Marlin form "
                                     "(weight-only layers have act_bits 16)"))
    data_type = settings.get("data_type")
    if quantized and data_type is not None and data_type != "int":
        problems.append(("data_type", f"data_type is {json.dumps(data_type)}: only integer weights (data_type "
                                      "\"int\") are the GPTQ codes Marlin takes"))
    for key in ("super_bits", "super_group_size"):
        if settings.get(key) is not None:
            problems.append((key, f"{key} is {json.dumps(settings[key])}: double-quantized scales (GGUF k-quants) "
                                  "have no Marlin form"))
    if settings.get("rotation_config"):
        problems.append(("rotation_config", "rotation_config is set: rotated weights need the rotation at run time, "
                                            "which a Marlin layer does not hold"))
    return problems


@dataclass(frozen=True)
class ModuleSettings:
    """What the config says about one module: the defaults, overridden by ``rule`` (the first matching
    ``dynamic`` key, AutoRound's ``extra_config`` entry, or its ``block_name_to_quantize`` leaving the module out;
    None: the defaults alone). ``quantized`` is False when that rule is a ``-:`` exclusion, an entry of bits 16 or the
    blocks. ``sym`` is None when no file states it (the stored zero points then decide)."""

    bits: int
    group_size: int
    sym: bool | None
    desc_act: bool
    rule: DynamicRule | ExtraEntry | BlockScope | None = None
    quantized: bool = True

    @property
    def origin(self) -> str:
        """Where these settings come from, for messages."""
        return f"{self.rule.kind} {json.dumps(self.rule.key)} in {self.rule.where}" if self.rule else "the config"


def _layout(settings: ModuleSettings) -> tuple:
    """What a module's settings decide about its stored tensors: not quantized, or its bits, group size and sym."""
    return (settings.bits, settings.group_size, settings.sym) if settings.quantized else ("not quantized",)


def _resolved(settings: ModuleSettings) -> tuple:
    """What a module's settings decide (not which rule decided them)."""
    return settings.bits, settings.group_size, settings.sym, settings.desc_act, settings.quantized


@dataclass(frozen=True)
class QuantConfig:
    """The GPTQ settings of a checkpoint, merged from ``config.json`` (``quantization_config``) and
    ``quantize_config.json`` (which wins where both name a key), every value type-checked.

    These are defaults: a layer's own settings come from :meth:`settings_for`, its full description from
    :func:`plan_layer`. ``as_read`` keeps the merged values exactly as the files wrote them.
    """

    bits: int
    group_size: int
    desc_act: bool
    sym: bool | None
    checkpoint_format: str  # "gptq" (v1) or "gptq_v2"; absent in the files means "gptq"
    dynamic: tuple[DynamicRule, ...]
    sources: list[str]
    as_read: dict
    #: config.json's ``dynamic`` rules where it lists quantize_config.json's rules in another order (else empty): a
    #: loader that reads config.json alone resolves with these, so every module must resolve alike under both
    dynamic_other_order: tuple[DynamicRule, ...] = ()
    #: the ``lm_head`` flag (GPTQModel: whether the module named ``lm_head`` is quantized), None where not stated,
    #: and the file that states it
    lm_head: bool | None = None
    lm_head_origin: str = ""
    #: AutoRound's ``extra_config`` entries (per-module overrides by full name or regex), in order
    extra_config: tuple[ExtraEntry, ...] = ()
    #: AutoRound's native format: the key that states its packing (None where assumed, or not AutoRound's), whether
    #: quant_method is AutoRound's, and its ``block_name_to_quantize`` (None where not stated)
    packing_key: str | None = None
    autoround: bool = False
    blocks: BlockScope | None = None
    source_format: ClassVar[str] = "gptq"

    @property
    def zero_format_label(self) -> str:
        return ZERO_FORMAT_OF_LABEL[self.checkpoint_format]

    @property
    def format_stated(self) -> bool:
        """Whether a config states the format (``checkpoint_format``, GPTQModel's ``format``, or AutoRound's packing
        key); where none does, ``checkpoint_format`` is GPTQ's default ``gptq`` (v1 zeros)."""
        return self.defaults().get("checkpoint_format") is not None or self.packing_key is not None

    @property
    def format_key(self) -> str:
        """The key that states the format, for messages: ``checkpoint_format``, or ``format`` where only GPTQModel's
        own key is written (both must agree where both are), or AutoRound's packing key where neither is."""
        if self.packing_key and self.as_read.get("checkpoint_format") is None and "format" not in self.as_read:
            return self.packing_key
        return "format" if self.as_read.get("checkpoint_format") is None and "format" in self.as_read else \
            "checkpoint_format"

    @property
    def format_value(self) -> str:
        """The format as the config states it under :attr:`format_key` (``gptq``, ``auto_round:auto_gptq``, ...)."""
        return str(self.as_read.get(self.format_key, self.checkpoint_format))

    def settings_for(self, module: str) -> ModuleSettings:
        """The settings of module ``module`` (a layer prefix such as ``model.layers.0.mlp.down_proj``): by ``dynamic``,
        or by AutoRound's ``extra_config`` and ``block_name_to_quantize`` where the config states them. Raises
        :class:`InputError` where config.json lists the ``dynamic`` rules in another order than quantize_config.json
        and this module resolves differently under the two orders, where ``dynamic`` and ``extra_config`` (or the
        blocks) give it different settings, and where ``extra_config`` resolves it ambiguously
        (:meth:`_resolve_extra`)."""
        settings = self._resolve(module, self.dynamic)
        if self.dynamic_other_order:
            other = self._resolve(module, self.dynamic_other_order)
            if _resolved(settings) != _resolved(other):
                raise InputError(
                    f"module '{module}': config.json (quantization_config) lists quantize_config.json's dynamic "
                    f"rules in another order, and the first match differs: {other.origin} against {settings.origin}",
                    hint="a loader that reads config.json alone would take other settings: write the rules in one "
                         "order")
        extra = self._resolve_extra(module) if self.extra_config else None
        if extra is None and self.blocks is not None and not self.blocks.holds(module):
            extra = self._defaults_by(self.blocks, quantized=False)
        if extra is None and not self.extra_config:
            return settings
        if not self.dynamic:
            return settings if extra is None else extra
        said = extra or self._defaults_by(None)
        if _layout(settings) != _layout(said):
            dynamic = settings.origin if settings.rule else "no dynamic rule (the config's defaults)"
            entry = extra.origin if extra else "no extra_config entry (the config's defaults)"
            if self.blocks is not None and extra is not None and extra.rule is self.blocks:
                entry = f"{extra.origin} (outside every block, no extra_config entry)"
            raise InputError(f"module '{module}': the config's dynamic rules and its extra_config disagree: "
                             f"{_describe_layout(settings)} by {dynamic}, {_describe_layout(said)} by {entry}",
                             hint="GPTQ loaders read dynamic, AutoRound's and vLLM's auto-round loaders extra_config: "
                                  "make both give every module the same settings (or remove one)")
        return settings

    def left_unquantized_by_default(self, module: str) -> bool:
        """Whether nothing but the defaults speaks of ``module`` in ``dynamic`` and AutoRound's
        ``block_name_to_quantize`` leaves it out (outside every block, no ``extra_config`` entry): an embedding or an
        ``lm_head`` stored as a plain ``.weight``, which a GPTQ loader reading ``dynamic`` leaves alone as well."""
        return (self.blocks is not None and not self.blocks.holds(module)
                and self._resolve(module, self.dynamic).rule is None
                and (not self.extra_config or self._resolve_extra(module) is None))

    def _resolve_extra(self, module: str) -> ModuleSettings | None:
        """The settings ``extra_config`` gives ``module``, or None where no entry speaks of it: the entry named by the
        module's own name, else the regex entries that match it (``re.search``), which must all give it the same
        settings (AutoRound's and vLLM's readers take the first in the file, AutoRound's pass over missing tensors the
        longest). A key with no regex character that is not the module's name but matches it as a regex (AutoRound's
        reader applies it, vLLM's does not) is refused: the readers would not agree. Raises :class:`InputError`."""
        named, any_plain, regexes = self._extra_index
        own = named.get(module)
        if own is not None:
            return self._from_entry(own)
        plain = None
        if any_plain is not None and config_regex_match(any_plain, module):  # (rare: the first such entry, named)
            plain = next(entry for entry in self.extra_config if not entry.is_regex and entry.matches(module))
        if plain is not None:
            raise InputError(f"module '{module}': {plain.where}: extra_config entry {json.dumps(plain.key)} is not "
                             "this module's name but matches it as a regular expression: AutoRound's loader applies "
                             "it to the module, vLLM's (which takes a key with no regex character for a module name) "
                             "does not",
                             hint=f"name the module exactly ('{module}'), or write a regular expression that says "
                                  "what it matches (such as '.*' or '$')")
        matched = [entry for entry in regexes if entry.matches(module)]
        if not matched:
            return None
        first = self._from_entry(matched[0])
        for entry in matched[1:]:
            other = self._from_entry(entry)
            if _layout(other) != _layout(first):
                raise InputError(f"module '{module}': {first.origin} gives it {_describe_layout(first)}, "
                                 f"{other.origin} {_describe_layout(other)}: readers that take the first matching "
                                 "entry and those that take the longest would disagree",
                                 hint="give the module an entry of its own name, or make the regular expressions "
                                      "match apart")
        return first

    @cached_property
    def _extra_index(self) -> tuple[dict[str, ExtraEntry], re.Pattern | None, tuple[ExtraEntry, ...]]:
        """``extra_config`` arranged for :meth:`_resolve_extra`, which runs once per module: the entries by key (the
        first of a key), one pattern that matches where any key with no regex character matches as a regular
        expression (``re.search``; None: no such key), and the regex entries in order. Per entry per module, an
        AutoRound config of 1,000 per-layer entries took 0.5 ms a module; such keys have no repeat (their only
        metacharacter is '.'), so their alternation costs what they cost one by one, without Python's loop."""
        named: dict[str, ExtraEntry] = {}
        for entry in self.extra_config:
            named.setdefault(entry.key, entry)
        plain = [entry.key for entry in self.extra_config if not entry.is_regex]
        any_plain = re.compile("(?s:.*?)(?:" + "|".join(plain) + ")") if plain else None
        return named, any_plain, tuple(entry for entry in self.extra_config if entry.is_regex)

    def _from_entry(self, entry: ExtraEntry) -> ModuleSettings:
        o = entry.overrides
        bits = o.get("bits", self.bits)
        return ModuleSettings(bits, o.get("group_size", self.group_size), o.get("sym", self.sym), self.desc_act,
                              entry, quantized=bits != UNQUANTIZED_BITS)

    def _resolve(self, module: str, rules: tuple[DynamicRule, ...]) -> ModuleSettings:
        for rule in rules:
            if rule.matches(module):
                if rule.excluded:
                    return self._defaults_by(rule, quantized=False)
                o = rule.overrides
                return ModuleSettings(o.get("bits", self.bits), o.get("group_size", self.group_size),
                                      o.get("sym", self.sym), o.get("desc_act", self.desc_act), rule)
        return self._defaults_by(None)

    def _defaults_by(self, rule: DynamicRule | BlockScope | None, quantized: bool = True) -> ModuleSettings:
        """The config's defaults as a module's settings, from ``rule`` (None: the defaults alone), which leaves the
        module unquantized where ``quantized`` is False."""
        return ModuleSettings(self.bits, self.group_size, self.sym, self.desc_act, rule, quantized=quantized)

    def defaults(self) -> dict:
        """The global settings exactly as the files wrote them, null where absent (the manifest's
        ``quantization_defaults``): ``checkpoint_format``, or GPTQModel's ``format`` where only that is written;
        ``extra_config`` where stated; from AutoRound's native format its ``quant_method``, packing key (where
        stated) and ``block_name_to_quantize``."""
        keys = ("bits", "group_size", "desc_act", "sym", "checkpoint_format", "dynamic")
        defaults = {key: self.as_read.get(key) for key in keys}
        if defaults["checkpoint_format"] is None:
            defaults["checkpoint_format"] = self.as_read.get("format")
        if "extra_config" in self.as_read:  # (AutoRound's: recorded where stated, so other outputs stay as they were)
            defaults["extra_config"] = self.as_read["extra_config"]
        if self.autoround:  # (its native format: the quant_method, packing and blocks, as written)
            defaults["quant_method"] = self.as_read["quant_method"]
            if self.packing_key:
                defaults[self.packing_key] = self.as_read[self.packing_key]
            defaults["block_name_to_quantize"] = self.as_read.get("block_name_to_quantize")
        return defaults

    def resolved_defaults(self) -> dict:
        """The global settings as this reader takes them, absent ones filled in (group size -1, desc_act false,
        checkpoint_format "gptq"; ``sym`` stays null), and the ``dynamic`` rules as written, in order ({} for none;
        the manifest's ``quantization_defaults`` has the same object), so ``extra_config`` where stated; from
        AutoRound's native format its ``quant_method``, ``packing_format`` (its default where none is stated) and
        blocks: ``inspect``'s plan."""
        resolved = {"bits": self.bits, "group_size": self.group_size, "desc_act": self.desc_act, "sym": self.sym,
                    "checkpoint_format": self.checkpoint_format, "dynamic": self.as_read.get("dynamic") or {}}
        if "extra_config" in self.as_read:
            resolved["extra_config"] = self.as_read["extra_config"] or {}
        if self.autoround:
            resolved["quant_method"] = self.as_read["quant_method"]
            resolved["packing_format"] = (self.as_read[self.packing_key] if self.packing_key
                                          else AUTOROUND_DEFAULT_PACKING)
            resolved["block_name_to_quantize"] = list(self.blocks.blocks) if self.blocks else None
        return resolved

    def describe(self) -> str:
        """One line for people: the global settings this reader takes."""
        return (f"config defaults: {self.bits}-bit, group size {self.group_size}, desc_act {self.desc_act}, "
                f"sym {'not stated' if self.sym is None else self.sym}"
                + (f", {len(self.dynamic)} dynamic rule(s)" if self.dynamic else "")
                + (f", {len(self.extra_config)} extra_config entr{'y' if len(self.extra_config) == 1 else 'ies'}"
                   if self.extra_config else "")
                + (f", AutoRound packing {self.format_value if self.packing_key else AUTOROUND_DEFAULT_PACKING} "
                   f"({self.zero_format_label} zeros)" if self.autoround else "")
                + (f", quantized blocks {self.blocks.key}" if self.blocks else ""))


def _describe_layout(settings: ModuleSettings) -> str:
    """A module's layout settings in words, for messages."""
    if not settings.quantized:
        return "not quantized"
    sym = "" if settings.sym is None else f", sym {json.dumps(settings.sym)}"
    return f"{settings.bits}-bit, group size {settings.group_size}{sym}"


def read_json(path: Path) -> dict:
    """The JSON object in ``path`` (a config or an index in a checkpoint directory, read there only:
    :func:`~marlin_convert.fileio.outside_link`). Raises :class:`InputError`."""
    if path.is_symlink() and not path.exists():
        raise InputError(f"{path}: {dead_link(path)}", hint="restore its target, or remove the link")
    refuse_outside_link(path, path.parent)
    if not path.is_file():  # a FIFO or a device would block or never end
        raise InputError(f"{path}: not a regular file")
    try:
        data = strict_json.loads(read_inside(path))
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object")
    return data


def _format_label(merged: dict, origin: dict[str, str]) -> str:
    """The one format label the config states (``checkpoint_format`` and GPTQModel's ``format`` must agree)."""
    labels = {}
    for key in ("checkpoint_format", "format"):
        if key in merged:
            labels[key] = typed(merged[key], str, key, origin[key]).lower()
    if "is_marlin_format" in merged and typed(merged["is_marlin_format"], bool, "is_marlin_format",
                                              origin["is_marlin_format"]):
        labels["is_marlin_format"] = "marlin"
    if any(label in MARLIN_LABELS for label in labels.values()):
        stated = ", ".join(f"{k}: {json.dumps(merged[k])}" for k in labels)  # as the file has them
        raise InputError(f"{origin[next(iter(labels))]}: already in Marlin format ({stated})",
                         hint="give the GPTQ checkpoint it was converted from")
    if len(set(labels.values())) > 1:
        raise InputError(f"{', '.join(sorted({origin[k] for k in labels}))}: format keys disagree: "
                         + ", ".join(f"{k} is {json.dumps(v)}" for k, v in labels.items()))
    label = next(iter(labels.values()), "gptq")
    if label not in ZERO_FORMAT_OF_LABEL:
        key = next(iter(labels))
        raise InputError(f"{origin[key]}: unknown {key} {json.dumps(label)} (expected gptq or gptq_v2)")
    return label


#: AutoRound's own quant_method labels (its native export; its ``auto_gptq`` export is GPTQ): read where the packing
#: format it states is a GPTQ tensor layout (:func:`autoround_zero_label`)
AUTOROUND_METHODS = ("auto-round", "intel/auto-round")
#: the quant_method values some reader of this package takes, for a did-you-mean on a mistyped one
KNOWN_METHODS = ("gptq", *AUTOROUND_METHODS, "compressed-tensors")
#: the keys that state an AutoRound checkpoint's packing: ``packing_format``; releases before it (quant_method
#: ``intel/auto-round``) wrote the same value under ``backend``
AUTOROUND_PACKING_KEYS = ("packing_format", "backend")
#: the packing vLLM's AutoRound reader assumes where a config states none
AUTOROUND_DEFAULT_PACKING = "auto_round:auto_gptq"
#: the output configs keep an AutoRound source's quant_method and packing key under these names (the keys themselves
#: say what the output is: quant_method "gptq", the packing key the Marlin label)
AUTOROUND_SOURCE_KEYS = {"quant_method": "source_quant_method", "packing_format": "source_packing_format",
                         "backend": "source_backend"}
AUTOROUND_HINT = ("export it with AutoRound's format \"auto_round\" for symmetric int layers (packing "
                  "auto_round:auto_gptq) or format \"auto_gptq\"; marlin-convert reads GPTQ tensor layouts only")


def _is_autoround(method) -> bool:
    """Whether a config's ``quant_method`` (any JSON value) names AutoRound's own format, in any case."""
    return isinstance(method, str) and method.lower() in AUTOROUND_METHODS


def autoround_zero_label(packing: str) -> str | None:
    """The GPTQ format label (zero format) of an AutoRound ``packing_format``, None where it is no GPTQ tensor layout.

    - any label naming GPTQ (``auto_round:auto_gptq``, ``auto_round:gptq``, older ``auto_round:gptq:exllamav2``,
      ``auto_gptq``): AutoGPTQ's layout, zero points stored minus 1 (v1), as AutoRound's GPTQ packers write them;
    - ``auto_round`` alone (AutoRound's own packing, which it writes for asymmetric layers): the same tensors, zero
      points stored as they are (v2);
    - AWQ (``auto_round:auto_awq``), GPTQModel's variant, float and every other packing: None.
    """
    label = packing.lower()
    if "awq" in label or "gptqmodel" in label:
        return None
    if "gptq" in label:
        return "gptq"
    return "gptq_v2" if label == "auto_round" else None


def _autoround_packing(merged: dict, origin: dict[str, str]) -> tuple[str | None, str]:
    """(the key that states an AutoRound config's packing, or None where none does; the zero-format label it means).
    Raises :class:`InputError` naming the file, key and value for a packing that is no GPTQ tensor layout."""
    key = next((key for key in AUTOROUND_PACKING_KEYS if merged.get(key) is not None), None)
    if key == "backend" and "packing_format" in merged:  # (a null packing_format states none; backend: a kernel name)
        key = None
    value = typed(merged[key], str, key, origin[key]) if key else AUTOROUND_DEFAULT_PACKING
    if key == "backend" and not any(word in value.lower() for word in ("auto_round", "gptq", "awq")):
        key, value = None, AUTOROUND_DEFAULT_PACKING  # (vLLM's kernel choice, "auto" / "marlin": no packing stated)
    label = autoround_zero_label(value)
    if label is None:
        what = ("AWQ's tensor layout (qweight packed along N in AutoAWQ's order), not GPTQ's" if "awq" in value.lower()
                else "not a GPTQ tensor layout")
        raise InputError(f"{origin[key]}: {key} is {json.dumps(value)}: {what}", hint=AUTOROUND_HINT)
    return key, label


@dataclass(frozen=True)
class BlockScope:
    """AutoRound's ``block_name_to_quantize`` as a module's reason for not being quantized: a module outside every
    block (``key``, the prefixes as written) that no ``extra_config`` entry names is left unquantized, as AutoRound's
    and vLLM's readers take it (``startswith`` on the module name)."""

    key: str
    blocks: tuple[str, ...]
    where: str
    kind: ClassVar[str] = "block_name_to_quantize"

    def holds(self, module: str) -> bool:
        return any(module.startswith(block) for block in self.blocks)

    def matches(self, module: str) -> bool:
        """Whether it speaks of ``module`` (as a dynamic rule or an extra_config entry that matches it): leaves it
        outside every block."""
        return not self.holds(module)


def parse_blocks(value, where: str) -> BlockScope | None:
    """``block_name_to_quantize`` (a comma-separated string or a list of strings; null: none) as a :class:`BlockScope`.
    Raises :class:`InputError` for another type."""
    if value is None:
        return None
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        names = value
    else:
        names = typed(value, str, "block_name_to_quantize", where).split(",")
    blocks = tuple(name.strip() for name in names if name.strip())
    return BlockScope(",".join(blocks), blocks, where) if blocks else None

#: settings that decide a layer's layout: config.json's quantization_config and quantize_config.json must not
#: state different values for them (the output's configs keep both files' values)
LAYOUT_KEYS = ("quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format", "format",
               "is_marlin_format", "dynamic", "lm_head", "extra_config", "packing_format", "block_name_to_quantize")


def _stated(key: str, value) -> str:
    """A layout setting as the two configs are compared: JSON text, so the order of ``dynamic``'s rules counts (the
    first match wins); no rules (null or {}) are one thing; labels compare without case, as they are read."""
    if key in ("quant_method", "checkpoint_format", "format", "packing_format", "backend") and isinstance(value, str):
        value = value.lower()
    if key in ("dynamic", "extra_config") and value is None:
        value = {}
    if key == "extra_config":  # (its order decides nothing: entries that could disagree by order are refused)
        return json.dumps(value, sort_keys=True)
    return json.dumps(value)


def _same_rules(first, second) -> bool:
    """Whether two ``dynamic`` objects hold the same rules, in whatever order."""
    if not isinstance(first, dict) or not isinstance(second, dict):
        return False
    return json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)


def _difference(key: str, first, second) -> str:
    """What differs between two statements of a layout setting, for the error (``dynamic``, ``extra_config``: the
    first rule or entry that one file has and the other lacks or states otherwise)."""
    if key in ("dynamic", "extra_config") and isinstance(first, dict) and isinstance(second, dict):
        what = "rule" if key == "dynamic" else "entry"
        for rule in list(first) + [rule for rule in second if rule not in first]:
            if rule not in second:
                return f"{what} {json.dumps(rule)} is only in config.json"
            if rule not in first:
                return f"{what} {json.dumps(rule)} is only in quantize_config.json"
            if json.dumps(first[rule], sort_keys=True) != json.dumps(second[rule], sort_keys=True):
                return f"{what} {json.dumps(rule)} is {json.dumps(first[rule])} against {json.dumps(second[rule])}"
    return f"{json.dumps(first)[:60]} against {json.dumps(second)[:60]}"


def load_quant_config(in_dir: Path) -> tuple[QuantConfig, dict | None, dict | None]:
    """Merge and type-check the GPTQ settings. Returns ``(config, config_json, quantize_config_json)`` (the raw
    dicts or None). Raises :class:`InputError` naming the file and key of a missing or ill-typed value."""
    config_path, quantize_path = in_dir / CONFIG_FILE, in_dir / QUANTIZE_CONFIG_FILE
    # lexists: a broken link is an error, not an absent file
    config_json = read_json(config_path) if os.path.lexists(config_path) else None
    quantize_json = read_json(quantize_path) if os.path.lexists(quantize_path) else None
    merged: dict = {}
    origin: dict[str, str] = {}
    sources: list[str] = []
    if config_json is not None and "quantization_config" in config_json:
        section = typed(config_json["quantization_config"], dict, "quantization_config", str(config_path))
        merged.update(section)
        origin.update(dict.fromkeys(section, f"{config_path} (quantization_config)"))
        sources.append(f"{CONFIG_FILE}:quantization_config")
    other_order: tuple[DynamicRule, ...] = ()
    if quantize_json is not None:
        said_autoround = any(_is_autoround(section.get("quant_method")) for section in (merged, quantize_json))
        # (AutoRound's older releases state the packing under backend: a layout key there, a kernel name elsewhere)
        for key in LAYOUT_KEYS + (("backend",) if said_autoround else ()):  # both files state the same settings
            if key in merged and key in quantize_json and _stated(key, merged[key]) != _stated(key, quantize_json[key]):
                if key == "dynamic" and _same_rules(merged[key], quantize_json[key]):
                    # transformers writes config.json with sorted keys, so its copy of the rules may come in another
                    # order: accepted where every layer resolves alike either way (QuantConfig.settings_for checks)
                    other_order = parse_dynamic(merged[key], f"{config_path} (quantization_config)")
                    continue
                raise InputError(f"{config_path} (quantization_config) and {quantize_path}: '{key}' disagrees: "
                                 f"{_difference(key, merged[key], quantize_json[key])}",
                                 hint="make the two configs agree with the stored tensors")
        merged.update(quantize_json)
        origin.update(dict.fromkeys(quantize_json, str(quantize_path)))
        sources.append(QUANTIZE_CONFIG_FILE)
    if not sources and config_json is not None and isinstance(config_json.get("compression_config"), dict):
        # early compressed-tensors releases (2024) saved the config under this key; vLLM and SGLang still read it
        method = config_json["compression_config"].get("quant_method")
        raise InputError(
            f"{config_path}: the quantization config is under 'compression_config' (quant_method "
            f"{json.dumps(method)}), the key early compressed-tensors releases wrote, not 'quantization_config'",
            hint="rename the key 'compression_config' to 'quantization_config' in config.json (its content is the "
                 "same) and convert again")
    if not sources:
        raise InputError(
            f"{in_dir}: no quantization config: neither {CONFIG_FILE} with 'quantization_config' "
            f"nor {QUANTIZE_CONFIG_FILE} found",
            hint="give a GPTQ or compressed-tensors checkpoint directory (with its config.json or quantize_config.json)",
        )
    method = merged.get("quant_method", "gptq")
    autoround = _is_autoround(method)
    if not autoround and (not isinstance(method, str) or method.lower() != "gptq"):
        close = difflib.get_close_matches(method.lower(), KNOWN_METHODS, n=1, cutoff=0.6) \
            if isinstance(method, str) else []
        raise InputError(f"{origin['quant_method']}: not a GPTQ checkpoint: quant_method is {json.dumps(method)}",
                         hint=(f"did you mean {json.dumps(close[0])}? " if close else "")
                         + "marlin-convert reads quant_method \"gptq\", AutoRound's \"auto-round\" (with a GPTQ "
                           "packing_format) and \"compressed-tensors\" (pack-quantized)")
    packing_key, packing_label = _autoround_packing(merged, origin) if autoround else (None, None)
    if merged.get("pack_dtype") is not None and str(merged["pack_dtype"]).removeprefix("torch.") != "int32":
        raise InputError(f"{origin['pack_dtype']}: pack_dtype {json.dumps(merged['pack_dtype'])}: GPTQ tensors packed "
                         "into int32 words are read, not other word sizes",
                         hint="quantize (or repack) with GPTQModel's default pack_dtype, int32")
    if "bits" not in merged:
        raise InputError(f"{in_dir}: quantization config ({', '.join(sources)}) has no 'bits'")

    def value(key: str, kind: type, default):
        return typed(merged[key], kind, key, origin[key]) if key in merged else default

    bits = _check_bits(value("bits", int, None), "bits", origin["bits"])
    for key, problem in _unservable(merged, quantized=True):  # (AutoRound states its scheme's keys at the top too)
        raise InputError(f"{origin[key]}: {problem}", hint=EXTRA_CONFIG_HINT)
    label = _format_label(merged, origin)
    if autoround:
        stated = [key for key in ("checkpoint_format", "format") if key in merged]
        if stated and label != packing_label:
            shown = f"{packing_key} {json.dumps(merged[packing_key])}" if packing_key else \
                f"no packing_format (AutoRound's default {AUTOROUND_DEFAULT_PACKING})"
            raise InputError(f"{origin[stated[0]]}: {stated[0]} {json.dumps(merged[stated[0]])} and {shown} say "
                             "different zero formats", hint="make the config state one format")
        label = packing_label
    config = QuantConfig(
        bits=bits,
        group_size=_check_group_size(value("group_size", int, -1), "group_size", origin.get("group_size", "")),
        desc_act=value("desc_act", bool, False),
        sym=value("sym", bool, None),
        checkpoint_format=label,
        dynamic=parse_dynamic(merged.get("dynamic"), origin.get("dynamic", "")),
        sources=sources,
        as_read=merged,
        dynamic_other_order=other_order,
        lm_head=value("lm_head", bool, None),
        lm_head_origin=origin.get("lm_head", ""),
        extra_config=parse_extra_config(merged.get("extra_config"), origin.get("extra_config", ""), bits),
        packing_key=packing_key,
        autoround=autoround,
        blocks=parse_blocks(merged.get("block_name_to_quantize"), origin.get("block_name_to_quantize", ""))
        if autoround else None,
    )
    check_model_dtype(config_json, config_path)
    return config, config_json, quantize_json


def check_model_dtype(config_json: dict | None, config_path: Path) -> None:
    """config.json's ``torch_dtype`` / ``dtype`` become the manifest's ``model_dtype``: each must be a JSON string
    (or absent / null). Raises :class:`InputError` naming the key and the file."""
    for key in ("torch_dtype", "dtype"):
        if config_json is not None and config_json.get(key) is not None:
            typed(config_json[key], str, key, str(config_path))


# ----------------------------------------------------------------------------------------------- the shards


@dataclass
class Checkpoint:
    """An opened source directory: configs, shard headers, and where every tensor lives.

    ``config`` is a :class:`QuantConfig` for GPTQ, a
    :class:`~marlin_convert.compressed_tensors.CompressedTensorsConfig` for compressed-tensors; its
    ``source_format`` says which."""

    path: Path
    config: QuantConfig
    config_json: dict | None
    quantize_json: dict | None
    shards: list[SafetensorsFile]
    index_json: dict | None
    location: dict[str, SafetensorsFile] = field(default_factory=dict)
    #: the index's file name where it is not model.safetensors.index.json (AutoGPTQ's
    #: ``gptq_model-4bit-128g.safetensors.index.json``): the output's rewritten index replaces it
    index_name: str | None = None
    #: the shards :meth:`read` reads through while :meth:`shards_held_open` holds them; None: one open per read
    held: HeldShards | None = field(default=None, repr=False, compare=False)

    @contextmanager
    def shards_held_open(self):
        """Within: :meth:`read` opens each shard once (:class:`~marlin_convert.safetensors_io.HeldShards`, with the
        same checks), not once per tensor; every descriptor is closed on leaving. Planning's are closed before any
        worker is forked; each worker holds its own while it runs a batch of jobs."""
        if self.held is not None:  # (held already by an enclosing block)
            yield
            return
        with HeldShards() as held:
            self.held = held
            try:
                yield
            finally:
                self.held = None

    def plain_linear_modules(self) -> list[str]:
        """The modules stored unquantized as linears: the prefix of every 2-D ``.weight`` tensor, in file order."""
        return [name.removesuffix(".weight") for name in self.location
                if name.endswith(".weight") and len(self.info(name).shape) == 2]

    def info(self, name: str) -> TensorInfo:
        return self.location[name].tensors[name]

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """Read one tensor (or, with ``index``, one leading-dimension slice of it)."""
        return read_tensor(self.location[name], name, index, self.held)

    @property
    def source_format(self) -> str:
        return self.config.source_format

    @property
    def total_bytes(self) -> int:
        return sum(s.path.stat().st_size for s in self.shards)

    @property
    def model_dtype(self):
        """config.json's ``torch_dtype`` (or newer ``dtype``) exactly as written, or None."""
        config = self.config_json or {}
        return config.get("torch_dtype", config.get("dtype"))


def open_checkpoint(in_dir: Path) -> Checkpoint:
    """Open the GPTQ checkpoint ``in_dir``: configs, the index (if sharded), every shard's header. Raises
    :class:`InputError`."""
    in_dir = Path(in_dir)
    if not in_dir.is_dir():
        raise InputError(f"{in_dir}: {'not a directory' if in_dir.exists() else 'does not exist'}")
    return open_shards(in_dir, *load_quant_config(in_dir))


def open_shards(in_dir: Path, config, config_json: dict | None, quantize_json: dict | None) -> Checkpoint:
    """The :class:`Checkpoint` of ``in_dir`` with its config already read: the index (if sharded) and every shard's
    header, each tensor found in exactly one shard. Raises :class:`InputError`."""
    index_path = in_dir / INDEX_FILE
    index_json = None
    if not os.path.lexists(index_path) and not os.path.lexists(in_dir / SINGLE_FILE):
        index_path = _named_index(in_dir) or index_path
    if os.path.lexists(index_path):
        index_json = read_json(index_path)
        weight_map = _check_index(index_path, index_json)
        shard_names = sorted(set(weight_map.values()))  # by file name (00001 first), not by first tensor
        _check_series_complete(in_dir, shard_names, index_path)
    elif os.path.lexists(in_dir / SINGLE_FILE):
        weight_map, shard_names = None, [SINGLE_FILE]
    else:
        found = sorted(p.name for p in in_dir.glob("*.safetensors"))
        if len(found) != 1:
            what = "no .safetensors file" if not found else f"{len(found)} .safetensors files and no {INDEX_FILE}"
            raise InputError(f"{in_dir}: not a GPTQ safetensors checkpoint: {what}")
        weight_map, shard_names = None, found

    where = index_path if index_json is not None else in_dir
    shards = [read_header(shard_path(in_dir, name, where)) for name in shard_names]
    checkpoint = Checkpoint(in_dir, config, config_json, quantize_json, shards, index_json,
                            index_name=index_path.name if index_json is not None else None)
    for shard in shards:
        for name in shard.tensors:
            if name in checkpoint.location:
                raise InputError(f"{shard.path}: tensor '{name}' also appears in {checkpoint.location[name].path.name}")
            checkpoint.location[name] = shard
    if weight_map is not None:
        by_name = {s.path.name: s for s in shards}
        for name, shard_name in weight_map.items():
            if name not in by_name[shard_name].tensors:
                raise InputError(f"{index_path}: maps tensor '{name}' to '{shard_name}', which does not contain it")
        for name, shard in checkpoint.location.items():
            if name not in weight_map:
                raise InputError(f"{index_path}: does not list tensor '{name}' found in {shard.path.name}")
    return checkpoint


#: an index named after its shards' base name, as AutoGPTQ (and GPTQModel before 1.0) write a sharded checkpoint:
#: ``<model_file_base_name>.safetensors.index.json`` beside ``<base>-00001-of-00002.safetensors``, the base name
#: ``gptq_model-4bit-128g`` unless one was given
_NAMED_INDEX_SUFFIX = ".safetensors.index.json"


def _named_index(in_dir: Path) -> Path | None:
    """The one ``<base>.safetensors.index.json`` in ``in_dir`` (not hidden), for a directory with neither
    ``model.safetensors.index.json`` nor ``model.safetensors``; None where there is none. Raises
    :class:`InputError` where there are several (which one the checkpoint is cannot be told)."""
    found = sorted(name for name in os.listdir(in_dir)
                   if name.endswith(_NAMED_INDEX_SUFFIX) and not name.startswith(".")
                   and len(name) > len(_NAMED_INDEX_SUFFIX))
    if len(found) > 1:
        raise InputError(f"{in_dir}: no {INDEX_FILE} but {len(found)} other safetensors indexes "
                         f"({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}): which one is the checkpoint?",
                         hint="move the indexes (and shards) that are not part of this checkpoint out of IN_DIR")
    return in_dir / found[0] if found else None


#: a shard of a numbered series, as transformers names them: <prefix>-00002-of-00004.safetensors
_SERIES_SHARD = re.compile(r"^(.+)-(\d+)-of-(\d+)\.safetensors$")


def _check_series_complete(in_dir: Path, shard_names: list[str], index_path: Path) -> None:
    """Raise :class:`InputError` where ``in_dir`` holds a shard of a numbered series the index uses (same prefix and
    count, ``model-00002-of-00002.safetensors``) that the index lists no tensor in: an index that lost entries would
    otherwise give an output without those layers, complete-looking (seen with every entry of the second shard
    deleted: exit 0, one layer and lm_head gone)."""
    series = {(m.group(1), m.group(3)) for m in map(_SERIES_SHARD.match, shard_names) if m}
    if not series:
        return
    listed = set(shard_names)
    for name in sorted(os.listdir(in_dir)):
        m = _SERIES_SHARD.match(name)
        if m and (m.group(1), m.group(3)) in series and name not in listed:
            raise InputError(f"{index_path}: lists no tensor in {name}, a shard of the same series beside it: the "
                             "index is incomplete",
                             hint="restore the index from where the checkpoint came from (or move the stray shard "
                                  "out of IN_DIR if it is not part of this checkpoint)")


def _check_index(index_path: Path, index_json: dict) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file name, both strings); ``metadata`` an object if present."""
    weight_map = index_json.get("weight_map")
    if not isinstance(weight_map, dict):
        raise InputError(f"{index_path}: no 'weight_map' object" if weight_map is None else
                         f"{index_path}: 'weight_map' is a JSON {type(weight_map).__name__}, not an object")
    if not weight_map:
        raise InputError(f"{index_path}: 'weight_map' is empty: it names no tensor and no shard")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise InputError(f"{index_path}: 'weight_map' maps tensor '{name}' to {shard!r}, not a file name")
    if not isinstance(index_json.get("metadata", {}), dict):
        raise InputError(f"{index_path}: 'metadata' is a JSON {type(index_json['metadata']).__name__}, not an object")
    return weight_map


def shard_path(directory: Path, name: str, where: Path) -> Path:
    """``directory / name`` for a shard file ``name`` read from ``where`` (an index, a manifest), checked.

    The name must be a plain file name in ``directory`` (no path separator, not ``.`` or ``..``), so nothing
    outside the directory is reached through it, ending in ``.safetensors`` (so no shard has the name of a file the
    converter writes beside the shards, such as ``marlin_manifest.json``). The entry must be a regular file, or a
    symbolic link to one (as in the Hugging Face cache, where snapshot files link to ``../../blobs/<hash>``; a link
    anywhere else out of ``directory`` is refused). Raises :class:`InputError` naming ``where`` and the name.
    """
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise InputError(f"{where}: shard name {name!r} is not a plain file name in {directory}",
                         hint="shards must lie directly in the checkpoint directory")
    if not name.endswith(".safetensors"):  # (nor the name of a file the converter writes: a config, the manifest)
        raise InputError(f"{where}: shard name {name!r} does not end in '.safetensors'",
                         hint="a checkpoint's shards are safetensors files named *.safetensors")
    path = directory / name
    if not os.path.lexists(path):
        raise InputError(f"{where}: names shard '{name}', which is missing")
    if not path.is_file():
        what = "a broken link" if path.is_symlink() and not path.exists() else "not a regular file"
        raise InputError(f"{where}: shard '{name}' is {what}")
    refuse_outside_link(path, directory)
    return path


def refuse_outside_link(path: Path, directory: Path) -> None:
    """Raise :class:`InputError` when ``path`` is a link out of ``directory`` (other than the Hugging Face cache's
    blobs, :func:`~marlin_convert.fileio.outside_link`): nothing outside the checkpoint is read."""
    target = outside_link(path, directory)
    if target is not None:
        raise InputError(f"{path}: a link to {target}, outside {directory}: not read",
                         hint="copy the file into the directory (links are followed only into a Hugging Face "
                              "cache's blobs)")


@dataclass
class LayerPlan:
    """One quantized linear (or one stacked set of experts) and what will become of it.

    ``spec`` describes it (shapes per expert); ``settings`` says what the config said and which ``dynamic`` rule
    applied. ``zero_stored`` is the constant stored qzeros value of a symmetric layer (None when asymmetric).
    ``convertible`` is False with ``reason`` set when the layer stays in GPTQ form (or stops the run).

    The converter reads a layer's tensors by *role*, the GPTQ tensor each one is (``qweight``, ``scales``,
    ``qzeros``, ``g_idx``): :attr:`roles` names the stored tensor of each role and :meth:`as_gptq` turns what is
    stored into GPTQ's orientation. For GPTQ both are the identity; another source format overrides them
    (:class:`~marlin_convert.compressed_tensors.CompressedTensorsLayer`).
    """

    prefix: str
    spec: QuantSpec
    settings: ModuleSettings
    has_g_idx: bool
    zero_stored: int | None = None
    convertible: bool = True
    reason: str | None = None
    #: the stored scales' dtype where no converted layer could have it (a kept fp8-scaled layer; the spec, which only
    #: describes such a layer, says float32), else None
    stored_scale_dtype: str | None = None

    def tensor(self, suffix: str) -> str:
        return f"{self.prefix}.{suffix}"

    @property
    def source_names(self) -> dict[str, str]:
        """The source tensors the manifest records for this layer (kind -> tensor name), each with its digest."""
        names = {"qweight": self.tensor("qweight"), "scales": self.tensor("scales"), "qzeros": self.tensor("qzeros")}
        if self.has_g_idx:
            names["g_idx"] = self.tensor("g_idx")
        return names

    @property
    def roles(self) -> dict[str, str]:
        """role -> stored tensor name, for every stored tensor a conversion consumes (none of them is copied)."""
        return self.source_names

    @property
    def kept_names(self) -> dict[str, str]:
        """The tensors that stay, unchanged, when the layer is kept in its source form."""
        return self.source_names

    def as_gptq(self, role: str, stored: np.ndarray) -> np.ndarray:
        """The stored tensor of ``role`` (or one expert slice of it) in GPTQ's orientation."""
        return stored

    def read_gptq(self, checkpoint: "Checkpoint", role: str, index: int | None = None) -> np.ndarray:
        """Read the tensor of ``role`` (one expert slice with ``index``), in GPTQ's orientation."""
        return self.as_gptq(role, checkpoint.read(self.roles[role], index))

    def source_extras(self) -> dict:
        """Fields the manifest's record of this source layer holds beyond the common ones (none for GPTQ)."""
        return {}

    @property
    def workspace_ints(self) -> int:
        return layout.workspace_ints(self.spec.padded_out_features)

    def refuse(self, reason: str) -> None:
        self.convertible = False
        self.reason = reason


def count_layers(layers: list[LayerPlan]) -> int:
    """How many linear layers ``layers`` hold, each expert of a stacked 3-D layer counted as one: the unit of the
    reports' "layer(s)" (``verify`` checks, and counts, every expert)."""
    return sum(max(layer.spec.num_experts, 1) for layer in layers)


def find_quantized_prefixes(checkpoint: Checkpoint) -> list[str]:
    """Prefixes ``P`` of every ``P.qweight`` in the checkpoint, in file order."""
    return [name[: -len(".qweight")] for name in checkpoint.location if name.endswith(".qweight")]


def expect_tensor(checkpoint: Checkpoint, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None,
                  needs: str = "a GPTQ linear needs qweight, qzeros and scales", meaning: str = "",
                  mismatch: type[InputError] = InputError) -> TensorInfo:
    """The header entry of tensor ``name``, which must exist (else ``needs`` says why it should) with one of
    ``dtypes`` and, unless ``shape`` is None, that shape (``meaning``, when given, follows the expected shape in the
    message). Raises :class:`InputError` naming the shard (``mismatch`` for another shape: a
    :class:`SettingsMismatchError` where the layer's settings decide the shape)."""
    if name not in checkpoint.location:  # named with the shard of the layer's packed weights, else the checkpoint
        prefix = name.rpartition(".")[0]
        anchor = next((checkpoint.location[f"{prefix}.{packed}"] for packed in ("qweight", "weight_packed")
                       if f"{prefix}.{packed}" in checkpoint.location), None)
        raise InputError(f"{anchor.path if anchor is not None else checkpoint.path}: tensor '{name}' is missing "
                         f"({needs})")
    info = checkpoint.info(name)
    where = checkpoint.location[name].path
    if info.dtype not in dtypes:
        wanted = " or ".join(DTYPE_NAMES.get(d, d) for d in dtypes)
        raise InputError(f"{where}: tensor '{name}' has dtype {DTYPE_NAMES.get(info.dtype, info.dtype)}, expected {wanted}")
    if shape is not None and info.shape != shape:
        raise mismatch(f"{where}: tensor '{name}' has shape {list(info.shape)}, expected {list(shape)}"
                         + (f" ({meaning})" if meaning else ""))
    return info


def num_groups(k: int, group_size: int) -> int:
    """G = ceil(K / g), 1 when channelwise (-1) or when the group size is at least K."""
    return 1 if group_size == -1 or group_size >= k else -(-k // group_size)


def _rows(count: int) -> str:
    return f"{count} row" + ("" if count == 1 else "s")


def _check_siblings(checkpoint: Checkpoint, prefix: str, suffix: str, num_experts: int, k: int,
                    settings: ModuleSettings) -> None:
    """Clearer messages than a bare shape mismatch for the two mistakes seen with experts: a stacked tensor
    whose expert count differs from qweight's, and scales/qzeros whose row count implies another group size."""
    name = f"{prefix}.{suffix}"
    if name not in checkpoint.location:
        return
    shape = checkpoint.info(name).shape
    where = checkpoint.location[name].path
    dims = 3 - (suffix == "g_idx")
    if num_experts and len(shape) != dims:
        raise InputError(f"{where}: tensor '{name}' has shape {list(shape)}: {len(shape)}-D, but {prefix}.qweight is "
                         f"3-D (stacked, {num_experts} experts), so {suffix} must be {dims}-D with the experts first")
    if num_experts and shape[0] != num_experts:
        raise InputError(f"{where}: tensor '{name}' has shape {list(shape)}: {shape[0] if shape else 0} experts, "
                         f"but {prefix}.qweight has {num_experts}")
    expected = num_groups(k, settings.group_size)
    if suffix in ("scales", "qzeros") and len(shape) >= 2 and shape[-2] != expected and shape[-2] > 0:
        rows = shape[-2]
        meaning = ("channelwise" if rows == 1 else f"group size {k // rows}" if k % rows == 0
                   else f"{rows} groups")
        stated = ("group_size" in checkpoint.config.as_read
                  or (settings.rule is not None and "group_size" in settings.rule.overrides))
        says = (f"{settings.origin} says group size {settings.group_size}" if stated else
                f"{settings.origin} states no group_size (so -1, channelwise)")
        raise SettingsMismatchError(f"{where}: tensor '{name}' has {_rows(rows)}: that is {meaning} for K = {k} "
                                    f"(qweight's {_rows(k * settings.bits // 32)} at {settings.bits} bits), but "
                                    f"{says} ({_rows(expected)})")


def _stored_bits_hint(rows: int, g_idx_k: int | None) -> str:
    """What the stored shapes imply where the config's bits contradict them: the bit width at which qweight's
    ``rows`` hold the K of g_idx, when there is one."""
    if g_idx_k and rows * 32 % g_idx_k == 0:
        return f"; g_idx's K = {g_idx_k} is what {rows} rows hold at {rows * 32 // g_idx_k} bits"
    return ""


#: the settings of a stacked tensor's layout that a ``dynamic`` rule decides, each with how a message says a value
#: (not desc_act: the stored g_idx decides act-order, per expert)
STACKED_RULE_KEYS = (("bits", "bits"), ("group_size", "group size"), ("sym", "sym"))


def _check_rules_for_stacked_experts(checkpoint: Checkpoint, prefix: str, num_experts: int,
                                     settings: ModuleSettings, where: Path) -> None:
    """A stacked 3-D layer ``<parent>.<projection>`` holds its experts in one tensor with one set of settings (its
    own, ``settings``): a ``dynamic`` rule that matches an expert by its per-expert name ``<parent>.<e>.<projection>``
    (as a per-expert checkpoint would name it) and gives it other settings (not quantized, other bits, group size or
    sym) cannot apply and is refused (:class:`InputError`), not ignored. A per-expert name that no rule matches takes
    the stacked layer's own settings (a rule written for the stacked name, ``+:.*experts\\.down_proj``, matches no
    per-expert name), and so does one whose rule matches the stacked name too (``+:.*``, after the stacked name's own
    rule): only a rule that singles out experts speaks of them."""
    if not (checkpoint.config.dynamic or checkpoint.config.extra_config):
        return
    parent, _, projection = prefix.rpartition(".")
    for expert in range(num_experts):
        module = f"{parent}.{expert}.{projection}"
        own = checkpoint.config.settings_for(module)
        if own.rule is None or own.rule.matches(prefix):
            continue
        differs = [(key, text) for key, text in STACKED_RULE_KEYS if getattr(own, key) != getattr(settings, key)]
        if own.quantized and not differs:
            continue
        if not own.quantized:
            says = f"says expert {expert} ('{module}') is not quantized"
        else:
            key, text = differs[0]
            says = f"gives expert {expert} ('{module}') {text} {json.dumps(getattr(own, key))}"
        raise InputError(f"{where}: layer '{prefix}' holds {num_experts} experts stacked in one tensor, but "
                         f"{own.origin} {says}: one stacked tensor has one set of settings ({settings.origin} for "
                         f"'{prefix}')",
                         hint=f"write the rule for the stacked module's own name ('{prefix}'), or store the experts "
                              "one tensor each")


def plan_layer(checkpoint: Checkpoint, prefix: str) -> LayerPlan:
    """Resolve one quantized linear's spec from its settings and tensors; check it; decide whether Marlin takes it.

    Raises :class:`InputError` for a malformed layer (inconsistent shapes, wrong dtypes, bad g_idx, settings the
    tensors contradict). Returns a plan with ``convertible=False`` and a reason for a well-formed layer that
    has no Marlin form here, or whose config and stored zero points contradict each other.
    """
    settings = checkpoint.config.settings_for(prefix)
    qweight = expect_tensor(checkpoint, f"{prefix}.qweight", ("I32",), None)
    where = checkpoint.location[qweight.name].path
    if len(qweight.shape) not in (2, 3):
        raise InputError(f"{where}: tensor '{qweight.name}' has shape {list(qweight.shape)}, expected 2-D or 3-D")
    if 0 in qweight.shape:
        raise InputError(f"{where}: tensor '{qweight.name}' has shape {list(qweight.shape)}: an empty layer "
                         "(no experts, rows or columns)")
    if not settings.quantized:
        raise InputError(f"layer '{prefix}': {settings.origin} says this module is not quantized, "
                         f"but '{qweight.name}' is stored")
    bits = settings.bits
    stacked = len(qweight.shape) == 3
    lead = qweight.shape[:1] if stacked else ()
    num_experts = qweight.shape[0] if stacked else 0
    if stacked:
        _check_rules_for_stacked_experts(checkpoint, prefix, num_experts, settings, where)
    rows, n = qweight.shape[-2:]
    k = rows * 32 // bits
    has_g_idx = f"{prefix}.g_idx" in checkpoint.location
    g_idx_shape = checkpoint.info(f"{prefix}.g_idx").shape if has_g_idx else None
    g_idx_k = g_idx_shape[-1] if has_g_idx and len(g_idx_shape) == len(lead) + 1 else None
    if rows * 32 % bits:
        raise SettingsMismatchError(f"{where}: tensor '{qweight.name}' has {rows} rows of int32: {rows * 32} bits per "
                                    f"column are not a whole number of {bits}-bit values ({settings.origin} says "
                                    f"bits = {bits})" + _stored_bits_hint(rows, g_idx_k))
    if g_idx_k is not None and g_idx_k != k:
        raise SettingsMismatchError(f"{checkpoint.location[prefix + '.g_idx'].path}: tensor '{prefix}.g_idx' has "
                                    f"shape {list(g_idx_shape)}, expected {[*lead, k]}: qweight's {rows} rows of "
                                    f"packed {bits}-bit values are K = {k} ({settings.origin} says bits = {bits})"
                                    + _stored_bits_hint(rows, g_idx_k))
    for suffix in ("scales", "qzeros", "g_idx"):
        _check_siblings(checkpoint, prefix, suffix, num_experts, k, settings)
    groups = num_groups(k, settings.group_size)
    scales = expect_tensor(checkpoint, f"{prefix}.scales", SCALE_DTYPES, (*lead, groups, n))
    expect_tensor(checkpoint, f"{prefix}.qzeros", ("I32",), (*lead, groups, -(-n * bits // 32)),
                  meaning=f"N = {n} zero points of {bits} bits packed in int32 words; {settings.origin} says bits = "
                          f"{bits}", mismatch=SettingsMismatchError)
    if has_g_idx:
        expect_tensor(checkpoint, f"{prefix}.g_idx", ("I32",), (*lead, k))
    act_order = (check_g_idx(checkpoint, f"{prefix}.g_idx", k, settings.group_size, num_experts) if has_g_idx
                 else False)
    spec = QuantSpec.create(bits=bits, group_size=settings.group_size, sym=settings.sym is not False,
                            zero_format=checkpoint.config.zero_format_label, act_order=act_order, in_features=k,
                            out_features=n, scale_dtype=DTYPE_NAMES[scales.dtype], num_experts=num_experts)
    plan = LayerPlan(prefix, spec, settings, has_g_idx)
    if bits not in MARLIN_BITS:
        plan.refuse(f"{bits}-bit weights: Marlin has 4- and 8-bit forms only")
        return plan
    _decide_zeros(checkpoint, plan)
    if not plan.convertible:
        return plan
    if settings.group_size not in SUPPORTED_GROUP_SIZES and not spec.channelwise:
        plan.refuse(f"group size {settings.group_size}: Marlin supports -1, 32, 64, 128 or a group size >= K")
    return plan


def check_g_idx(checkpoint: Checkpoint, name: str, k: int, group_size: int, num_experts: int) -> bool:
    """Read the g_idx tensor ``name``; raise on values out of range or groups of the wrong size; return True when
    non-trivial.

    Every group holds g rows, except the last, which holds K - (G - 1) * g (fewer when g does not divide K).
    """
    per_expert = checkpoint.read(name).reshape(-1, k)
    path = checkpoint.location[name].path
    groups = num_groups(k, group_size)
    group = k if groups == 1 else group_size
    if per_expert.min() < 0 or per_expert.max() >= groups:
        raise InputError(
            f"{path}: tensor '{name}': g_idx values must lie in 0..{groups - 1}, "
            f"found {int(per_expert.min())}..{int(per_expert.max())}"
        )
    expected = np.full(groups, group)
    expected[-1] = k - (groups - 1) * group
    trivial = layout.trivial_g_idx(k, group)
    non_trivial = False
    for expert, row in enumerate(per_expert):
        counts = np.bincount(row, minlength=groups)
        if (counts != expected).any():
            bad = int(np.flatnonzero(counts != expected)[0])
            where = f" (expert {expert})" if num_experts else ""
            raise InputError(
                f"{path}: tensor '{name}'{where}: g_idx is unbalanced: group {bad} has {int(counts[bad])} rows, "
                f"expected {int(expected[bad])} (K = {k}, group size {group})"
            )
        non_trivial |= not np.array_equal(row, trivial)
    return non_trivial


def stored_zeros(checkpoint: Checkpoint, plan: LayerPlan) -> np.ndarray | None:
    """Every stored qzeros value of the layer (all experts): uint8 ``[E*G, N]``. Refuses the layer (returns None)
    when the unused slots past N in the last word of a row are not 0: the inverse writes 0 there, so such a
    layer could not be rebuilt bit for bit."""
    spec = plan.spec
    words = plan.read_gptq(checkpoint, "qzeros")
    words = words.reshape(-1, words.shape[-1])
    slots = layout.unpack_gptq_qzeros(words, words.shape[-1] * spec.pack_factor, spec.bits)
    if slots[:, spec.out_features:].any():
        plan.refuse(f"{plan.roles['qzeros'].rsplit('.', 1)[-1]}: the unused slots past N = {spec.out_features} in "
                    "the last word of a row of zero points are not 0, so the conversion could not be proven lossless")
        return None
    return slots[:, : spec.out_features]


def _decide_zeros(checkpoint: Checkpoint, plan: LayerPlan) -> None:
    """Settle ``sym`` and ``zero_format`` from the config and the stored qzeros, or refuse the layer.

    - ``sym: false`` stays asymmetric whatever the values (zero format from the config's label: v1 stores
      zero - 1, so a stored 2^b - 1 means a zero point of 2^b, which does not exist: refused).
    - ``sym: true`` needs one value everywhere, the symmetric one (7 / 127 for v1, 8 / 128 for v2): the values
      decide v1 or v2, whatever the label says (a note reports it). Anything else contradicts the config.
    - ``sym`` not stated: the symmetric value everywhere means symmetric, anything else asymmetric.
    """
    spec, settings = plan.spec, plan.settings
    stored = stored_zeros(checkpoint, plan)
    if stored is None:
        return
    values = np.unique(stored)
    symmetric = {fmt: symmetric_stored_zero(spec.bits, fmt) for fmt in ("v1", "v2")}
    by_value = {value: fmt for fmt, value in symmetric.items()}
    if settings.sym is not False and values.size == 1 and int(values[0]) in by_value:
        fmt = by_value[int(values[0])]
        plan.spec = replace(spec, sym=True, zero_format=fmt)
        plan.zero_stored = int(values[0])
        return
    if settings.sym is True:
        found = (f"{values.size} different values ({int(values.min())}..{int(values.max())})" if values.size > 1
                 else f"{int(values[0])} everywhere")
        plan.refuse(f"{settings.origin} says sym: true, but qzeros hold {found}, not the symmetric value "
                    f"{symmetric['v1']} (v1) or {symmetric['v2']} (v2): the config contradicts the stored zero "
                    "points; not converted")
        return
    plan.spec = replace(spec, sym=False)
    top = (1 << spec.bits) - 1
    if spec.zero_format == "v1" and int(values.max()) == top:
        plan.refuse(f"asymmetric v1 zero points: stored value {top} means zero point {top + 1}, outside "
                    f"0..{top} (v1 stores zero - 1, so it cannot hold zero point 0)")


def plan_layers(checkpoint: Checkpoint) -> list[LayerPlan]:
    """A :class:`LayerPlan` for every quantized linear, in file order. Raises on the first malformed layer."""
    prefixes = find_quantized_prefixes(checkpoint)
    if not prefixes:
        raise InputError(f"{checkpoint.path}: not a GPTQ checkpoint: no tensor named '*.qweight'")
    _refuse_layers_without_qweight(checkpoint, set(prefixes))
    _check_lm_head_flag(checkpoint, prefixes)
    config = checkpoint.config
    if config.dynamic_other_order or (config.dynamic and config.extra_config):
        # the rules in config.json's order (or extra_config beside dynamic) must resolve the modules stored unquantized
        # alike too (an excluded module that config.json's order quantizes would be loaded as quantized by a loader
        # reading config.json alone)
        for module in checkpoint.plain_linear_modules():
            if not config.left_unquantized_by_default(module):
                config.settings_for(module)
    plans = []
    for prefix in prefixes:
        try:
            plans.append(plan_layer(checkpoint, prefix))
        except SettingsMismatchError as exc:
            with_unused_rules(checkpoint, exc)
            raise
    return plans


#: how many of the config's unused rules a hint or a note names (the others are counted)
UNUSED_SHOWN = 3


def stored_module_names(checkpoint: Checkpoint) -> list[str]:
    """The modules ``checkpoint`` stores, as the config's rules are matched against them: the prefix ``P`` of every
    tensor ``P.<name>`` (quantized or plain linears, norms, embeddings; per-expert or stacked, as stored, whatever a
    conversion makes of them), and for a stacked 3-D quantized layer ``<parent>.<projection>`` its experts'
    per-expert names ``<parent>.<e>.<projection>``, which the rules are resolved for too
    (:func:`_check_rules_for_stacked_experts`). Names longer than MAX_MATCHED_NAME are left out: no rule is matched
    against them (a quantized layer of such a name is refused)."""
    names = dict.fromkeys(name.rpartition(".")[0] for name in checkpoint.location)
    for prefix in find_quantized_prefixes(checkpoint):
        shape = checkpoint.info(f"{prefix}.qweight").shape
        if len(shape) == 3:
            parent, _, projection = prefix.rpartition(".")
            names.update(dict.fromkeys(f"{parent}.{expert}.{projection}" for expert in range(shape[0])))
    return [name for name in names if name and len(name) <= MAX_MATCHED_NAME]


def unused_rules(checkpoint: Checkpoint) -> list[DynamicRule | ExtraEntry]:
    """The config's ``dynamic`` rules and AutoRound ``extra_config`` entries that match no module the checkpoint
    stores (:func:`stored_module_names`), in the config's order: a typo in one (``gate_prj``) leaves it silently
    unused. A rule that matches a stored module counts as used whether or not an earlier one wins there, and whatever
    the module is stored as (a ``-:`` rule for a plain ``.weight`` decides nothing the conversion does, but says what
    a loader does). Empty for a compressed-tensors checkpoint, whose config has neither."""
    config = checkpoint.config
    if not isinstance(config, QuantConfig) or not (config.dynamic or config.extra_config):
        return []
    names = stored_module_names(checkpoint)
    stored = set(names)
    # GPTQModel writes a rule for lm_head, and AutoRound an entry, on their own (the user wrote neither); where no
    # lm_head is stored at all (tied to the embeddings, as with lm_head false it often is) such a rule names nothing
    # by design, not by a typo, and a note on every such checkpoint would teach users to skip the notes
    no_head = not any(is_lm_head(name) for name in names)
    parts = ".".join({part for name in names for part in name.split(".")})
    return [rule for rule in (*config.dynamic, *config.extra_config)
            if not (isinstance(rule, ExtraEntry) and rule.key in stored)  # (by name: a per-layer entry, no scan)
            and not (no_head and rule.matches("lm_head"))
            and (_names_what_is_not_stored(rule, parts) or not any(rule.matches(name) for name in names))]


def _names_what_is_not_stored(rule: DynamicRule | ExtraEntry, parts: str) -> bool:
    """Whether ``rule`` is an ``extra_config`` key with no regex character (a module's name, '.' its only wildcard)
    one of whose pieces between the dots is in no stored name's parts (``parts``: every dot-separated part of the
    stored names, joined by dots): it then matches no stored name, as a name or as a regex (a piece holds no dot, so
    it would lie within one part), and needs no scan of every name (500 per-expert entries of another prefix took
    8 s against the 18,771 names of a 48-layer MoE, its 6,144 would take about 100 s; 0.04 s now)."""
    return isinstance(rule, ExtraEntry) and not rule.is_regex and any(piece not in parts
                                                                      for piece in rule.key.split("."))


def describe_unused(rules: list[DynamicRule | ExtraEntry]) -> str:
    """``rules`` (:func:`unused_rules`, at least one) in words: the first :data:`UNUSED_SHOWN` by kind and key as
    written, and how many more."""
    shown = ", ".join(f"{rule.kind} '{rule.key}'" for rule in rules[:UNUSED_SHOWN])
    if len(rules) == 1:
        return f"{shown} matches no module in the checkpoint"
    more = f" (and {len(rules) - UNUSED_SHOWN} more)" if len(rules) > UNUSED_SHOWN else ""
    return f"{len(rules)} rules of the config match no module in the checkpoint: {shown}{more}"


def unused_rule_notes(rules: list[DynamicRule | ExtraEntry]) -> list[str]:
    """The plan's notes on ``rules`` (:func:`unused_rules`; matched against the source's own module names:
    --stack-experts renames its experts afterwards). An override that matches nothing is likely a typo. An exclusion
    (``-:``, or an entry of bits 16) that matches nothing changes nothing, and producers and users write them by design
    for parts of a model family a checkpoint does not store (``-:.*visual.*`` on a text-only checkpoint, ``-:.*mtp.*``
    where the MTP layers are dropped, a MoE router's ``-:.*mlp\\.gate$`` on a dense model): it is noted as such, not
    as a typo."""
    notes = []
    overrides = [rule for rule in rules if not rule.excluded]
    if overrides:
        notes.append(f"{describe_unused(overrides)}: no module takes its settings from "
                     f"{'it' if len(overrides) == 1 else 'them'} (a typo in a module name?)")
    exclusions = [rule for rule in rules if rule.excluded]
    if exclusions:
        notes.append(f"{describe_unused(exclusions)}: {'it excludes' if len(exclusions) == 1 else 'they exclude'} "
                     "nothing here (usual for parts of the model family this checkpoint does not store: a vision "
                     "tower, MTP layers, a MoE router; a typo only if a module meant to stay unquantized is converted)")
    return notes


def with_unused_rules(checkpoint: Checkpoint, error: InputError) -> InputError:
    """``error``, a layer whose stored tensors contradict the settings the config resolves for it, with a hint naming
    the config's rules that match no stored module (:func:`unused_rules`), where there are any: a rule meant for the
    layer but mistyped is the likely cause, and the error alone names only the rule that did apply."""
    unused = unused_rules(checkpoint)
    if unused:
        meant = "it was" if len(unused) == 1 else "they were"
        said = f"{describe_unused(unused)} (a typo? the modules {meant} meant for take other settings)"
        error.hint = f"{error.hint}; {said}" if error.hint else said
    return error


def quantized_by_config(checkpoint: Checkpoint, modules: list[str]) -> dict[str, tuple[bool, str]]:
    """Per module of ``modules``: whether the config quantizes it, and what says so (``the config``, or the first
    matching ``dynamic`` rule and its file: a ``-:`` rule leaves the module unquantized)."""
    out = {}
    for module in modules:
        settings = checkpoint.config.settings_for(module)
        out[module] = (settings.quantized, settings.origin)
    return out


def is_lm_head(module: str) -> bool:
    """Whether ``module`` is the output head the GPTQ ``lm_head`` flag speaks of (GPTQModel's ``lm_head`` module)."""
    return module.rsplit(".", 1)[-1] == "lm_head"


def lm_head_contradiction(flag: bool | None, quantized: list[str], plain: list[str]) -> str | None:
    """The module the ``lm_head`` flag contradicts, else None: ``false`` with a quantized ``lm_head`` among
    ``quantized``, or ``true`` with none there and an ``lm_head`` among ``plain`` (stored unquantized). Not stated,
    or an ``lm_head`` not stored at all (tied to the embeddings), contradicts nothing."""
    heads = [module for module in quantized if is_lm_head(module)]
    if flag is False and heads:
        return heads[0]
    plain_heads = [module for module in plain if is_lm_head(module)]
    if flag is True and not heads and plain_heads:
        return plain_heads[0]
    return None


def _check_lm_head_flag(checkpoint: Checkpoint, prefixes: list[str]) -> None:
    """Refuse an ``lm_head`` flag the stored tensors contradict, as a ``-:`` rule on a stored qweight is."""
    config = checkpoint.config
    module = lm_head_contradiction(config.lm_head, prefixes, checkpoint.plain_linear_modules())
    if module is None:
        return
    stored = (f"'{module}.qweight' is stored" if config.lm_head is False
              else f"'{module}.weight' is stored unquantized (no '{module}.qweight')")
    raise InputError(f"{config.lm_head_origin}: lm_head is {json.dumps(config.lm_head)}, but {stored}",
                     hint="make the config's lm_head say whether the checkpoint stores the lm_head quantized")


def _refuse_layers_without_qweight(checkpoint: Checkpoint, prefixes: set[str]) -> None:
    """A prefix with two or more of a GPTQ layer's other tensors (scales, qzeros, g_idx) but no qweight is a layer
    whose weights are missing (a shard lost a tensor): refused, not copied through as if it were not quantized."""
    parts: dict[str, list[str]] = {}
    for name in checkpoint.location:
        prefix, _, suffix = name.rpartition(".")
        if suffix in ("scales", "qzeros", "g_idx") and prefix and prefix not in prefixes:
            parts.setdefault(prefix, []).append(name)
    for prefix, names in parts.items():
        if len(names) >= 2:
            where = checkpoint.location[names[0]].path
            raise InputError(f"{where}: layer '{prefix}' has {', '.join(sorted(n.rsplit('.', 1)[1] for n in names))} "
                             f"but no '{prefix}.qweight' in any shard")


def plan_notes(checkpoint: Checkpoint, layers: list[LayerPlan]) -> list[str]:
    """Say how each converted layer's zero format was decided where the config did not settle it alone (layers kept
    in GPTQ form are copied unchanged: not counted)."""
    config = checkpoint.config
    label = config.zero_format_label
    unlabelled = f"no checkpoint_format label: GPTQ's default {label}"
    notes = []
    symmetric = [layer for layer in layers if layer.zero_stored is not None and layer.convertible]
    for fmt in sorted({layer.spec.zero_format for layer in symmetric}):
        chosen = [layer for layer in symmetric if layer.spec.zero_format == fmt]
        stored = sorted({layer.zero_stored for layer in chosen})
        if fmt != label:
            said = (f"{config.format_key} says {config.format_value} ({label} zeros)" if config.format_stated
                    else f"{unlabelled} zeros,")
            notes.append(f"{said} but qzeros of {count_layers(chosen)} symmetric layer(s) hold "
                         f"{'/'.join(map(str, stored))}, the {fmt} value: treated as {fmt}")
        else:
            notes.append(f"zero format {label} for {count_layers(chosen)} symmetric layer(s) (qzeros hold "
                         f"{'/'.join(map(str, stored))}), {'as labelled' if config.format_stated else unlabelled}")
    asymmetric = [layer for layer in layers if layer.convertible and not layer.spec.sym]
    if asymmetric:
        said = f"from {config.format_key} {config.format_value}" if config.format_stated else unlabelled
        notes.append(f"{count_layers(asymmetric)} asymmetric layer(s): zero points read as {label} ({said}"
                     f"{', v1 stores zero - 1' if label == 'v1' else ''}); written to zp")
    unstated = [layer for layer in layers if layer.settings.sym is None and layer.convertible]
    if unstated:
        asymmetric = count_layers([layer for layer in unstated if not layer.spec.sym])
        notes.append(f"no 'sym' in the config for {count_layers(unstated)} layer(s): decided from the stored zero "
                     f"points ({count_layers(unstated) - asymmetric} symmetric, {asymmetric} asymmetric)")
    reordered = [layer for layer in layers
                 if layer.convertible and layer.spec.act_order and not layer.settings.desc_act]
    if reordered:
        notes.append(f"{count_layers(reordered)} layer(s) have a g_idx that is not trivial while the config says "
                     "desc_act false: converted with act-order (perm, as the g_idx says); the configs keep desc_act "
                     "false, so a loader that goes by desc_act alone would ignore perm")
    in_order = [layer for layer in layers
                if layer.convertible and not layer.spec.act_order and layer.settings.desc_act]
    if in_order:
        notes.append(f"{count_layers(in_order)} layer(s) have desc_act true in the config but a g_idx in order "
                     "(GPTQModel's static_groups, or none stored): converted without act-order (no perm); the "
                     "configs keep desc_act true, so a loader that goes by desc_act alone would look for perm, and "
                     "the legacy Marlin loaders refuse the checkpoint")
    return notes
