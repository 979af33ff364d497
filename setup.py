"""Builds the CPU kernel, an XLA FFI custom call, against jaxlib's FFI headers (metadata: pyproject.toml)."""

import os

import jaxlib
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cpu_kernels._bsr_t_matmul",
            sources=["cpu_kernels/bsr_t_matmul.cc"],
            include_dirs=[os.path.join(os.path.dirname(jaxlib.__file__), "include")],
            # -Wno-psabi: Vec16 helpers are always inlined, so the AVX-512 argument ABI note is moot.
            extra_compile_args=["-O3", "-std=c++17", "-Wno-psabi"],
            language="c++",
        )
    ]
)
