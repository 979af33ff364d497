"""Builds the CPU kernel, an XLA FFI custom call, against jaxlib's FFI headers (metadata: pyproject.toml)."""

import os

import jaxlib
from setuptools import Extension, setup

setup(
    # The headers are compiled into the extension, not imported; listed so that an sdist carries them.
    package_data={"cpu_kernels": ["tile_kernel.h", "work_queue.h"]},
    ext_modules=[
        Extension(
            "cpu_kernels._bsr_t_matmul",
            sources=["cpu_kernels/bsr_t_matmul.cc", "cpu_kernels/quantize_blocks.cc"],
            depends=["cpu_kernels/tile_kernel.h", "cpu_kernels/work_queue.h"],
            include_dirs=[os.path.join(os.path.dirname(jaxlib.__file__), "include")],
            # No -march: the AVX2 and AVX-512 paths are separate functions with target attributes, picked
            # per call by CPU features, so one build runs on any x86-64. -Wno-psabi: the vector helpers
            # are always inlined, so the note about passing wide vectors by value is moot.
            extra_compile_args=["-O3", "-std=c++17", "-Wno-psabi"],
            language="c++",
        )
    ]
)
