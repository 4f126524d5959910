"""The per-layer quantization spec: one frozen description of a quantized linear, read by every stage.

A reader (:mod:`marlin_convert.gptq` for GPTQ) resolves it once per layer from the checkpoint's config, its
per-module rules and the stored tensors; the plan, the converter, the manifest, ``inspect`` and ``verify``
read it and never re-derive a setting from the global config. Build one with :meth:`QuantSpec.create`::

    spec = QuantSpec.create(bits=4, group_size=128, sym=True, zero_format="v1", act_order=False,
                            in_features=1000, out_features=1000, scale_dtype="float16")
    spec.num_groups                 # 8: seven groups of 128, then 104 rows
    spec.padded_shape               # (1024, 1024): K up to whole groups, N up to the 64-column tile

Notation as in FORMAT.md: K, N logical in/out features, g the effective group size (K when channelwise),
b bits, p = 32 / b values per int32 word, bias = 2^(b-1).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import layout

SCALE_DTYPE_NAMES = ("float16", "bfloat16", "float32")
ZERO_FORMATS = ("v1", "v2")
SOURCE_FORMATS = ("gptq", "compressed-tensors")


@dataclass(frozen=True)
class QuantSpec:
    """How one quantized linear (or one stacked set of experts; shapes are per expert) is quantized.

    ``group_size`` is the value the config gives this layer (-1 = channelwise); ``zero_format`` says how the
    source stores zero points ("v1": true zero - 1, "v2": the true zero); ``act_order`` is True only when the
    stored g_idx is non-trivial. Derived values (effective group size, groups, padded shape) are properties.
    """

    bits: int
    group_size: int
    sym: bool
    zero_format: str
    act_order: bool
    in_features: int
    out_features: int
    scale_dtype: str
    num_experts: int = 0
    source_format: str = "gptq"

    @classmethod
    def create(cls, *, bits: int, group_size: int, sym: bool, zero_format: str, act_order: bool, in_features: int,
               out_features: int, scale_dtype: str, num_experts: int = 0,
               source_format: str = "gptq") -> "QuantSpec":
        """Build a spec, checking that every value is of the right kind (ValueError naming the field if not).

        Whether the layer has a Marlin form is not decided here (see :attr:`padded_shape`): a spec also
        describes layers that stay in their source form.
        """
        for name, value in (("bits", bits), ("group_size", group_size), ("in_features", in_features),
                            ("out_features", out_features), ("num_experts", num_experts)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if bits <= 0 or in_features <= 0 or out_features <= 0 or num_experts < 0:
            raise ValueError(f"bits {bits}, K {in_features}, N {out_features}, experts {num_experts}: out of range")
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"group_size must be -1 (channelwise) or positive, got {group_size}")
        if not isinstance(sym, bool) or not isinstance(act_order, bool):
            raise ValueError(f"sym and act_order must be bools, got {sym!r}, {act_order!r}")
        if zero_format not in ZERO_FORMATS:
            raise ValueError(f"zero_format must be one of {ZERO_FORMATS}, got {zero_format!r}")
        if scale_dtype not in SCALE_DTYPE_NAMES:
            raise ValueError(f"scale_dtype must be one of {SCALE_DTYPE_NAMES}, got {scale_dtype!r}")
        if source_format not in SOURCE_FORMATS:
            raise ValueError(f"source_format must be one of {SOURCE_FORMATS}, got {source_format!r}")
        return cls(bits, group_size, sym, zero_format, act_order, in_features, out_features, scale_dtype,
                   num_experts, source_format)

    @property
    def channelwise(self) -> bool:
        """One scale row per column: group size -1, or a group size of at least K."""
        return self.group_size == -1 or self.group_size >= self.in_features

    @property
    def effective_group_size(self) -> int:
        """g: rows per scale group (K when channelwise); the last group may be shorter when g does not divide K."""
        return self.in_features if self.channelwise else self.group_size

    @property
    def num_groups(self) -> int:
        """G = ceil(K / g): rows of scales (and of qzeros / zp)."""
        return -(-self.in_features // self.effective_group_size)

    @property
    def pack_factor(self) -> int:
        """p = 32 / b values per int32 word."""
        return 32 // self.bits

    @property
    def bias(self) -> int:
        """2^(b-1): the zero point of a symmetric layer (8 for 4-bit, 128 for 8-bit)."""
        return 1 << (self.bits - 1)

    @property
    def padded_shape(self) -> tuple[int, int]:
        """(K_pad, N_pad) of the Marlin form: K up to whole groups (channelwise: to 16), N up to 64.

        Equal to (K, N) when the layer already tiles. Raises ValueError when the layer has no Marlin form
        (a grouped layer whose group size is not a multiple of 16).
        """
        return layout.padded_shape(self.in_features, self.out_features, self.effective_group_size)

    @property
    def padded_in_features(self) -> int:
        return self.padded_shape[0]

    @property
    def padded_out_features(self) -> int:
        return self.padded_shape[1]

    @property
    def padded(self) -> bool:
        return self.padded_shape != (self.in_features, self.out_features)
