"""What a compiled step needs on a GPU or TPU, measured on any machine: deviceless compilation.

XLA's GPU and TPU compilers run on the host without an accelerator. Compiled for a topology
description, a jitted step gets the buffer plan the accelerator would run: its peak is what a
device must hold, after XLA's fusion, rematerialisation and scheduling (which a jaxpr's residuals
do not see). ``compiled_memory(step, *args, target="h100")`` returns it with the FLOPs, a modelled
step time (XLA:TPU's own cost model on TPU; a per-kernel roofline over the optimized HLO on H100,
``bsr_jax.measure.roofline``) and, with ``breakdown=True``, the buffers live at the peak and the costliest
kernels, by the op that produced them (module paths come from the ops' names). See docs/memory.md.

Deviceless targets (``DEVICELESS_TARGETS``, any case) need the ``aot`` extra (``pip install
"bsr-jax[aot]"``: jax's CUDA plugin and libtpu at jax's version; no CUDA toolkit, driver or TPU
needed) and, on a machine without a GPU, jax started without its CUDA platform
(``JAX_PLATFORMS=cpu``, which importing ``bsr_jax`` before jax sets where the user has not); the
error of a failed start names whichever is missing, the extra first. Not seen by these figures: the allocator's fragmentation and reserved memory, cuDNN/cuBLAS
workspaces beyond XLA's own scratch, and anything outside the compiled step (input pipeline, host
copies).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.util
import os
import re
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bsr_jax.measure import roofline as roofline_lib
from bsr_jax.measure.hlo_text import op_names, parse_hlo

# The H100 SXM device description (the form of XLA's xla/tools/hlo_opt/gpu_specs).
H100_CONFIG = os.path.join(os.path.dirname(__file__), "h100_sxm.txtpb")
# XLA:GPU tunes GEMM algorithms on a device; without one, its heuristic tile sizes (autotune level 0).
_GPU_OPTIONS = {"xla_gpu_autotune_level": 0}
_UNTILED = "Couldn't find output tile sizes"  # XLA:GPU's error where no Triton tiling fits deviceless
DEVICELESS_TARGETS = ("h100", "tpu-v5p")  # compiled for without the device
TARGETS = ("host", *DEVICELESS_TARGETS)


# What the ``aot`` extra installs for each deviceless target: any one of these sets is enough.
_PLUGINS = {"h100": (("jax_cuda12_plugin", "jax_plugins.xla_cuda12"), ("jax_cuda13_plugin", "jax_plugins.xla_cuda13")),
            "tpu-v5p": (("libtpu",),)}  # fmt: skip


def check_target(target: str, allowed: tuple[str, ...] = TARGETS) -> str:
    """``target`` in lower case (``"H100"`` is ``"h100"``), or a ``ValueError`` naming ``allowed``."""
    name = target.lower() if isinstance(target, str) else target
    if name not in allowed:
        raise ValueError(f"target must be one of {allowed} (any case), got {target!r}")
    return name


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module stubbed out as None
        return False


def plugin_installed(target: str) -> bool:
    """Whether the compiler plugin a deviceless ``target`` needs (the ``aot`` extra's jax CUDA
    plugin, or libtpu) is installed, whether or not jax could start it."""
    library = os.environ.get("TPU_LIBRARY_PATH")
    if target == "tpu-v5p" and library and os.path.exists(library):
        return True
    return any(all(_installed(m) for m in modules) for modules in _PLUGINS[target])


def target_devices(target: str) -> tuple[Any, ...]:
    """Devices of a deviceless ``target`` topology (``"h100"``: 8 GPUs of one host; ``"tpu-v5p"``:
    a 2x2x2 slice: 8 chips), or the host's own for ``"host"``; any case."""
    return _target_devices(check_target(target))


@functools.cache
def _target_devices(target: str) -> tuple[Any, ...]:
    if target == "host":
        return tuple(jax.devices())
    from jax.experimental import topologies

    try:
        if target == "h100":
            with open(H100_CONFIG) as f:
                config = f.read()
            topo = topologies.get_topology_desc(platform="cuda", topology="1x1x8", target_config=config)
        else:
            # Compiling needs no TPU, so several processes (pytest workers) may load libtpu at once.
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
            topo = topologies.get_topology_desc(topology_name="v5p:2x2x2", platform="tpu")
    except (RuntimeError, ImportError) as e:
        install = 'pip install "bsr-jax[aot]" (jax\'s CUDA plugin and libtpu, at jax\'s version; no GPU, TPU or CUDA toolkit needed)'
        if "lockfile" in str(e):
            hint = "another process holds libtpu (one at a time)"
        elif not plugin_installed(target):
            # Checked before the platform setting: without the plugin, no setting helps.
            hint = f"its compiler plugin ({'jax_cuda12_plugin' if target == 'h100' else 'libtpu'}) is not installed: {install}"
        elif target == "h100" and "cuda" not in jax.devices()[0].platform and not os.environ.get("JAX_PLATFORMS"):
            # Without a GPU, jax's CUDA plugin fails its driver check and registers only when the
            # platforms to start are named (and exclude cuda).
            hint = "set JAX_PLATFORMS=cpu before jax starts (without a GPU the CUDA plugin registers only then)"
        else:
            hint = f"its plugin is installed but did not start; reinstall it at jax's version: {install}"
        raise RuntimeError(f"cannot compile for {target} on this machine: {hint} ({e})") from e
    return tuple(topo.devices)


def target_mesh(target: str, devices: int = 1, axis_names: tuple[str, ...] = ("data",)) -> Mesh:
    """A mesh of ``devices`` devices of ``target``, as a 1-D mesh (or reshaped to ``axis_names``'
    length when it is 2: ``(devices // 2, 2)``)."""
    found = target_devices(target)
    if not 1 <= devices <= len(found):
        raise ValueError(f"devices must be in [1, {len(found)}] for {target}, got {devices}")
    grid = np.array(found[:devices])
    if len(axis_names) == 2:
        grid = grid.reshape(devices // 2, 2)
    return Mesh(grid, axis_names)


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's ``memory_analysis()`` of a compiled function, in bytes."""

    temp: int
    arguments: int
    outputs: int
    aliased: int

    @property
    def peak(self) -> int:
        """Upper bound of live bytes: temporaries plus arguments plus outputs not aliased."""
        return self.temp + self.arguments + self.outputs - self.aliased

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> CompiledMemory:
        """The memory analysis of an already compiled function."""
        stats = compiled.memory_analysis()
        if stats is None:
            raise RuntimeError("the compiler reports no memory analysis for this program")
        return cls(
            temp=int(stats.temp_size_in_bytes),
            arguments=int(stats.argument_size_in_bytes),
            outputs=int(stats.output_size_in_bytes),
            aliased=int(stats.alias_size_in_bytes),
        )


@dataclasses.dataclass(frozen=True)
class LiveBuffer:
    """Bytes live at the peak that one op produced (``op``: its name, module path included)."""

    op: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """A compiled function's memory plan and cost, in bytes, FLOPs and seconds.

    ``peak`` is XLA's own peak (arguments, outputs and temporaries as its heap places them: tile
    padding and the gaps its packing leaves included); on the host, whose XLA:CPU peak counts only
    arguments and outputs, it is ``CompiledMemory.peak``'s bound (temp + arguments + outputs -
    aliased) wherever XLA's figure is below ``temp``, so never a peak below the temporaries; ``flops`` is the compiler's count, or where it
    reports none (XLA:GPU) the roofline's count of matmul and convolution FLOPs;
    ``optimal_seconds`` is XLA:TPU's modelled step time (None elsewhere, and where its cost model
    cannot time the program); it counts a while loop's body once, whatever its trip count.
    ``modelled_seconds`` is the step time to compare settings by on the target: on TPU
    ``optimal_seconds`` times the roofline's ratio of the program with its loops' trips to the
    program with each loop body once (1 without loops: a scanned model's layers or micro-batches
    are then counted as often as they run; approximate where XLA's model and the roofline weigh
    the loop differently), the roofline's (``roofline_seconds``) on H100; None on the host.
    ``roofline_seconds`` is the per-kernel roofline of the optimized HLO with the target's figures (``bsr_jax.measure.roofline``), on TPU too, where it checks the method against XLA's own model.
    With a breakdown: ``kernels`` are every kernel of the roofline, costliest first (``op``: the
    op name of the instruction, or of what a fusion XLA left unnamed computes, module path
    included), ``transfers`` its host copies, ``live_at_peak`` lists the buffers
    live at the busiest point of XLA's live-range analysis, largest first (named the same way), and ``live_peak`` is
    their sum in the arrays' own (unpadded) sizes. The two peaks are counted differently: on XLA:TPU
    ``peak`` also holds tile padding and the gaps the heap's packing leaves, and they differ either
    way (docs/memory.md). Empty and None unless asked for.
    """

    target: str
    peak: int
    temp: int
    arguments: int
    outputs: int
    aliased: int
    flops: float | None
    optimal_seconds: float | None
    modelled_seconds: float | None = None
    roofline_seconds: float | None = None
    live_at_peak: tuple[LiveBuffer, ...] = ()
    live_peak: int | None = None
    kernels: tuple[roofline_lib.Kernel, ...] = ()
    transfers: tuple[roofline_lib.Kernel, ...] = ()
    triton_gemm: bool = False  # GEMMs compiled as Triton fusions (True) or cuBLAS calls (``compiled_memory(triton_gemm=)``)

    def by_module(self, depth: int = 2) -> dict[str, int]:
        """Live-at-peak bytes summed by the first ``depth`` components of each op's module path
        (block indices kept), e.g. ``{"block3/fc1": ...}``; parameters and optimizer state under
        their argument names."""
        totals: dict[str, int] = {}
        for buffer in self.live_at_peak:
            path = _module_path(buffer.op, depth)
            totals[path] = totals.get(path, 0) + buffer.bytes
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def _module_path(op: str, depth: int) -> str:
    parts = [p for p in op.split("/") if p and not re.match(r"^(jit|jvp|transpose|vmap|checkpoint|remat)\(", p)]
    parts = [re.sub(r"\{\d+\}$", "", p) for p in parts]
    return "/".join(parts[:depth]) or op


def _placed(args: Any, mesh: Mesh) -> Any:
    # Arrays and shape structs without a sharding are replicated on the target's mesh; structs that
    # carry a sharding (e.g. from target_mesh) keep it.
    def place(a):
        if isinstance(a, jax.ShapeDtypeStruct) and isinstance(a.sharding, NamedSharding):
            return a
        return jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=NamedSharding(mesh, PartitionSpec()))

    return jax.tree.map(place, args)


_LIVE = re.compile(r"── (.+?) \([\d.]+%, total: [\d\s\u202f\xa0]+ bytes, current: ([\d\s\u202f\xa0]+) bytes")


_LIVE_PEAK = re.compile(r"Stack trace breakdown for peak usage: ([\d\s\u202f\xa0]+) bytes")


def _live_at_peak(dump_dir: str, names: dict[str, str]) -> tuple[tuple[LiveBuffer, ...], int | None]:
    """The 'Stack trace breakdown for peak usage' of XLA's live-range dump of the largest module,
    and the total it names (None where the dump has no breakdown). A buffer the dump names by its
    instruction (``fusion.926``) takes that instruction's op name from ``names``."""
    dumps = glob.glob(os.path.join(dump_dir, "*after_optimizations-live-range.txt"))
    if not dumps:
        raise RuntimeError(f"XLA wrote no live-range dump in {dump_dir}: no breakdown for this target")
    with open(max(dumps, key=os.path.getsize)) as f:
        text = f.read()
    section = text[text.index("Stack trace breakdown") :] if "Stack trace breakdown" in text else ""
    found = [LiveBuffer(names.get(op, op).removeprefix("jit(").split(")/", 1)[-1], int(re.sub(r"\D", "", m.group(2))))
             for m in _LIVE.finditer(section) for op in [m.group(1)]]
    total = _LIVE_PEAK.search(section)
    live_peak = int(re.sub(r"\D", "", total.group(1))) if total else None
    return tuple(sorted((b for b in found if b.bytes), key=lambda b: -b.bytes)), live_peak


def lower_for(
    fn: Callable[..., Any], *args: Any, target: str = "host", devices: int = 1, donate_argnums: int | tuple[int, ...] = ()
) -> jax.stages.Lowered:
    """``fn(*args)`` lowered for ``target``, as ``compile_for`` lowers it: cheap beside compiling,
    and two lowerings with the same ``as_text()`` compile to the same program."""
    target = check_target(target)
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be an int >= 1, got {devices!r}")
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn, donate_argnums=donate_argnums)
    if target != "host":
        args = _placed(args, target_mesh(target, devices))
    return jitted.lower(*args)


def compile_for(
    fn: Callable[..., Any] | jax.stages.Lowered,
    *args: Any,
    target: str = "host",
    devices: int = 1,
    donate_argnums: int | tuple[int, ...] = (),
    options: dict[str, Any] | None = None,
    triton_gemm: bool | None = None,
) -> jax.stages.Compiled:
    """``fn(*args)`` compiled for ``target`` (nothing runs), as ``compiled_memory`` compiles it;
    ``fn`` may be ``lower_for``'s result (then ``args`` are unused). ``options`` are extra XLA
    compile options; ``triton_gemm`` (``"h100"`` only): ``None`` compiles GEMMs as a real H100 does,
    as Triton fusions (dequantizing or scaling producers fused into the GEMM), where XLA finds a
    tiling without the device, else as cuBLAS calls with a ``UserWarning`` saying so; ``True``:
    Triton or a ``RuntimeError``; ``False``: cuBLAS. Read the program with ``.as_text()``; which
    GEMMs it has with ``uses_triton_gemm`` of that text."""
    target = check_target(target)
    if triton_gemm and target != "h100":
        raise ValueError(f"triton_gemm=True is for target='h100' (XLA:GPU), got target={target!r}")
    lowered = fn if isinstance(fn, jax.stages.Lowered) else lower_for(fn, *args, target=target, devices=devices, donate_argnums=donate_argnums)
    if target != "h100":
        return lowered.compile(options or None)
    try:
        return lowered.compile(_GPU_OPTIONS | {"xla_gpu_enable_triton_gemm": triton_gemm is not False} | (options or {}))
    except Exception as error:  # XLA raises its own runtime error type
        if triton_gemm is False or _UNTILED not in str(error):
            raise
        why = f"XLA:GPU found no Triton tiling for a GEMM of this program without a device ({str(error).splitlines()[0][:200]})"
        if triton_gemm:
            raise RuntimeError(f"{why}; compile it with triton_gemm=False (cuBLAS) or None (Triton where it tiles)") from error
    warnings.warn(f"{why}: compiled with cuBLAS GEMMs instead (triton_gemm=False); a real H100 would tile it with autotuning",
                  UserWarning, stacklevel=2)  # fmt: skip
    return lowered.compile(_GPU_OPTIONS | {"xla_gpu_enable_triton_gemm": False} | (options or {}))


def uses_triton_gemm(hlo_text: str) -> bool:
    """Whether an XLA:GPU program (its ``compiled.as_text()``) computes its GEMMs in Triton fusions
    (else cuBLAS custom calls)."""
    # XLA's fusion kinds: __triton_gemm, __triton_nested_gemm_fusion (the generic emitter's form).
    return re.search(r'"kind":"__triton[a-z_]*gemm', hlo_text) is not None


def _tpu_seconds(optimal: float | None, modelled: roofline_lib.Roofline | None) -> float | None:
    """XLA:TPU's step time with every while-loop body counted as often as it runs: XLA's cost model
    counts a body once (a scan over the same work in 1, 2, 4 and 8 trips: 101, 49, 39 and 33 us on
    TPU v5p), so its figure is scaled by the roofline's, which counts the trips; plus the roofline's
    time of the kernels XLA's model cannot see (splash attention: XLA counted 5 MFLOP for a
    program whose splash kernels compute 14.5 GFLOP)."""
    if optimal is None or modelled is None or not modelled.seconds_loops_once:
        return optimal
    return optimal * modelled.seconds / modelled.seconds_loops_once + modelled.uncosted_seconds


def compiled_memory(
    fn: Callable[..., Any],
    *args: Any,
    target: str = "host",
    devices: int = 1,
    donate_argnums: int | tuple[int, ...] = (),
    breakdown: bool = False,
    triton_gemm: bool | None = None,
) -> CompiledStep:
    """Compile ``fn(*args)`` for ``target`` (nothing runs) and read XLA's memory plan and cost.

    Args:
      fn: a function or a ``jax.jit``-ed one (then ``donate_argnums`` is its own), or
        ``lower_for``'s result for the same ``target`` (then ``args`` are unused).
      *args: arrays or ``jax.ShapeDtypeStruct``; placed replicated on ``devices`` devices of the
        target unless they carry a ``NamedSharding`` already (build one on ``target_mesh``).
      target: ``"host"`` (this machine's backend), ``"h100"`` (XLA:GPU for an H100 SXM) or
        ``"tpu-v5p"`` (XLA:TPU), in any case; the last two need the ``aot`` extra
        (``pip install "bsr-jax[aot]"``), and a ``RuntimeError`` says so where it is missing.
      devices: devices of the target to place replicated arguments on.
      donate_argnums: arguments whose buffers the step may reuse (params and optimizer state of a
        training step), as ``jax.jit``'s.
      breakdown: also list the buffers live at the peak (compiles with XLA's dump into a temporary
        directory), every kernel of the roofline and its host copies.
      triton_gemm: ``"h100"`` only: ``None`` (the default) compiles GEMMs as a real H100 does, as
        Triton fusions, where XLA tiles them without the device, else as cuBLAS calls with a
        ``UserWarning`` (ViT-B/16's step does not tile deviceless); ``True``: Triton or a
        ``RuntimeError``; ``False``: cuBLAS (the instrument of docs/RESULTS.md sections 10-13).
        ``CompiledStep.triton_gemm`` says which the program has.
    """
    target = check_target(target)
    with tempfile.TemporaryDirectory() as dump_dir:
        options = {"xla_dump_to": dump_dir} if breakdown else {}
        compiled = compile_for(fn, *args, target=target, devices=devices, donate_argnums=donate_argnums, options=options,
                               triton_gemm=triton_gemm)  # fmt: skip
        # The program's text, read once where the roofline, the GEMM kind or the breakdown's names parse it.
        text = compiled.as_text() if target in roofline_lib.HARDWARE or breakdown else ""
        names = op_names(parse_hlo(text)[0]) if breakdown else {}
        live, live_peak = _live_at_peak(dump_dir, names) if breakdown else ((), None)
    memory = CompiledMemory.of(compiled)
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    # XLA:TPU reports a negative time for programs its cost model cannot time.
    optimal = seconds if (seconds := cost.get("optimal_seconds")) is None or seconds >= 0 else None
    modelled = roofline_lib.roofline(text, target) if target in roofline_lib.HARDWARE else None
    # XLA's own peak as scheduled where it reports one; else the bound CompiledMemory gives. XLA:CPU's
    # peak leaves its temporaries out (arguments and outputs only): on the host, the bound instead.
    peak = int(getattr(compiled.memory_analysis(), "peak_memory_in_bytes", 0)) or memory.peak
    if target == "host" and peak < memory.temp:
        peak = memory.peak
    return CompiledStep(
        target=target,
        peak=peak,
        **{f.name: getattr(memory, f.name) for f in dataclasses.fields(CompiledMemory)},
        flops=cost.get("flops", modelled.flops if modelled else None),
        optimal_seconds=optimal,
        modelled_seconds=_tpu_seconds(optimal, modelled) if target.startswith("tpu") else modelled and modelled.seconds,
        roofline_seconds=modelled and modelled.seconds,
        live_at_peak=live,
        live_peak=live_peak,
        kernels=modelled.kernels if breakdown and modelled else (),
        transfers=modelled.transfers if breakdown and modelled else (),
        triton_gemm=target == "h100" and uses_triton_gemm(text),
    )
