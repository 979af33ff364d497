"""The suite runs on the CPU. JAX_PLATFORMS=cpu also lets jax's CUDA plugin (the ``aot`` extra)
register without a GPU, which deviceless H100 compiles need (bsr_jax.measure.compiled).

Many tests compile the same program (the CLI's step in every smoke, resume and error run; the same
tiny steps across files), so one run shares JAX's persistent compilation cache in a fresh folder:
the xdist workers and the CLI subprocesses inherit it. Programs and results are unchanged (a hit
loads the executable XLA built for the same module); it halved tests/train/test_cli.py (87 s -> 46 s).
Every program is cached, however quick its compile: the eager ops the tests run (each one an XLA
program) are then compiled once for both workers (test_linear, test_storage, test_format and
test_compression: 85 s -> 78 s).

XLA:CPU's LLVM runs at -O0 (``--xla_backend_optimization_level=0``): the suite's programs are tiny
and compiled once or twice each, so their compile time, not their run time, is what the suite
spends; -O0 takes 40% off tests/bsr_jax/test_linear.py + test_conv.py (104 s -> 65 s). LLVM's
optimisation levels keep IEEE semantics (XLA:CPU sets no fast-math flags), and XLA's own HLO passes
(fusion, layout, buffer assignment) are unchanged, so results and compiled peaks are too. XLA:CPU
emits its fusions through LLVM IR directly instead of its MLIR fusion emitters, in one module
(``--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1``): an eager op
compiles in half the time (the four files above 78 s -> 56 s; the whole suite 871 s -> 644 s on a
2-core AMD EPYC, 2026-11-28) from the same HLO; the suite passes either way (its comparisons are
between programs of one run). Deviceless TPU compiles take the same time either way. Deviceless H100 programs are assembled by
ptxas without its optimisations (``--xla_gpu_disable_gpuasm_optimizations``: ResMLP-S12's int4 step
12.4 s -> 10.7 s to compile, the same buffers): the machine code is never run here. Subprocesses inherit the flag
(``host_devices.xla_flags`` adds their device count to it)."""

import fnmatch
import os
import shutil
import tempfile

import pytest
from sweeps import DEFAULT_CASES

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0"
                               " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
                               " --xla_gpu_disable_gpuasm_optimizations=true").strip()  # fmt: skip
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the controller's choice reaches the workers
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="bsr-jax-tests-xla-cache-")
    os.environ["BSR_JAX_TESTS_OWN_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def pytest_sessionfinish(session, exitstatus):
    """The process that made the cache folder removes it (xdist's workers finish first)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None and os.environ.get("BSR_JAX_TESTS_OWN_CACHE"):
        shutil.rmtree(os.environ["BSR_JAX_TESTS_OWN_CACHE"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Cases of a sweep that ``tests/sweeps.py`` does not keep in the default run are ``slow``; a
    sweep of which it keeps nothing is an error (a renamed case must not drop its claim silently)."""
    kept_cases: dict[str, int] = {}
    for item in items:
        test, _, params = item.nodeid.partition("[")
        globs = DEFAULT_CASES.get(test)
        if globs is None or not params:
            continue
        kept = any(fnmatch.fnmatchcase(params[:-1], glob) for glob in globs)
        kept_cases[test] = kept_cases.get(test, 0) + kept
        if not kept:
            item.add_marker(pytest.mark.slow)
    if empty := [test for test, n in kept_cases.items() if n == 0]:
        raise pytest.UsageError(f"tests/sweeps.py keeps no case of {empty}: fix its globs")
