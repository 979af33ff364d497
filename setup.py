"""Builds the CPU kernel, an XLA FFI custom call, against jaxlib's FFI headers (metadata: pyproject.toml)."""

import os
from concurrent.futures import ThreadPoolExecutor

import jaxlib
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class ParallelBuildExt(build_ext):
    """Compiles an extension's sources at once, one compiler process each (setuptools' ``-j`` runs
    extensions, not sources, in parallel): the install's build 15 s -> 10 s on 2 cores."""

    def build_extensions(self):
        compile_sources = self.compiler.compile

        def compile_each(sources, *args, **kwargs):
            with ThreadPoolExecutor(max(1, min(len(sources), os.cpu_count() or 1))) as pool:
                objects = pool.map(lambda source: compile_sources([source], *args, **kwargs), sources)
                return [obj for objs in objects for obj in objs]

        self.compiler.compile = compile_each
        super().build_extensions()


setup(
    cmdclass={"build_ext": ParallelBuildExt},
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
            # are always inlined, so the note about passing wide vectors by value is moot. -g0: no debug
            # information (Python's build flags ask for it), 20% of the compile.
            extra_compile_args=["-O3", "-std=c++17", "-Wno-psabi", "-g0"],
            language="c++",
        )
    ]
)
