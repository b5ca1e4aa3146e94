"""Builds the optional C kernels (gossipdl.compression._native); everything else is in
pyproject.toml. Without a C compiler the build skips them and the numpy kernels run instead."""

import os

from setuptools import Extension, setup

native = Extension(
    "gossipdl.compression._native",
    ["gossipdl/compression/_native.c"],
    # No FMA contraction: every instruction set rounds as torch does (a*b, then + c). No
    # trapping math: loops with floorf and float selects vectorize (values are unchanged).
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-trapping-math"],
    libraries=["m"],
    optional=True,  # a failed compile is a warning: the package still installs
)

setup(ext_modules=[native] if os.name == "posix" else [])
