"""What our own Triton kernels (``pallas_kernels``) cost to the roofline: XLA:GPU's Triton call keeps
no ``pl.CostEstimate``, so their FLOPs come from their operands' shapes (``pallas_kernels.KERNEL_FLOPS``),
and their time is stretched by what a GPU measured of them: their grids in whole waves over the SMs, at
the share of peak one program reaches (``pallas_kernels.KERNEL_EFFICIENCY``)."""

from __future__ import annotations

import math
import re

import pallas_kernels
from bsr_jax.measure.hardware import Hardware
from bsr_jax.measure.hlo_text import Instr, arrays, attr, dims


def kernel(instr: Instr) -> str | None:
    """The name of the ``pallas_kernels`` kernel a Triton custom call runs, or None for any other call."""
    if "triton" not in (attr(instr.attrs, "custom_call_target") or ""):
        return None
    found = re.search(r'name = "(\w+)"', instr.attrs)
    return found.group(1) if found and found.group(1) in pallas_kernels.KERNEL_FLOPS else None


def _rate_dtype(name: str, instr: Instr, shapes: dict[str, str]) -> str | None:
    operand = pallas_kernels.KERNEL_FLOPS[name][1]
    return None if operand is None else next(arrays(shapes[instr.operands[operand]]))[0]


def flops(name: str, instr: Instr, shapes: dict[str, str], hw: Hardware) -> tuple[float, float]:
    """(FLOPs, seconds at peak) of kernel ``name``: from its operands, at the rate of the dtype its
    ``KERNEL_FLOPS`` entry names (the default rate where none)."""
    count = pallas_kernels.KERNEL_FLOPS[name][0]
    f = float(count([dims(shapes[o]) for o in instr.operands], next(arrays(instr.type.removeprefix("(")))[1]))
    dtype = _rate_dtype(name, instr, shapes)
    return f, f / (hw.default_flops if dtype is None else hw.matmul_flops.get(dtype, hw.default_flops))


def slowdown(name: str, instr: Instr, shapes: dict[str, str], hw: Hardware) -> float:
    """How much longer than its roofline kernel ``name`` runs: its grid in whole waves of ``hw.sms``
    programs (36 programs on 132 SMs take a wave's time for 27% of its work), over the share of the
    matrix units' peak one program reaches (``KERNEL_EFFICIENCY``, measured on a GPU; 1 where not)."""
    grid = [int(n) for n in re.findall(r"grid_[xyz] = (\d+)", instr.attrs)]
    if not (grid and hw.sms):
        return 1.0
    programs = math.prod(grid)
    waves = math.ceil(programs / hw.sms) * hw.sms / programs
    return waves / pallas_kernels.KERNEL_EFFICIENCY.get(name, {}).get(_rate_dtype(name, instr, shapes), 1.0)
