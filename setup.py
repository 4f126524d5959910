"""Build the optional C fast path of the repack (marlin_convert/_repack.c). Everything else is in pyproject.toml.

The extension is optional: where no C compiler is available the package installs without it and
marlin_convert.layout falls back to its numpy implementation (same output, several times slower).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("marlin_convert._repack", ["marlin_convert/_repack.c"], optional=True,
                             extra_compile_args=["-O3"])])
