"""marlin-convert: convert 4- and 8-bit GPTQ (and compressed-tensors) safetensors checkpoints to the Marlin tile format, offline, and
prove every layer right.

The library never prints: it returns results and raises :class:`marlin_convert.errors.MarlinConvertError`
subclasses; :mod:`marlin_convert.cli` renders both.
"""

__version__ = "0.1.0"
