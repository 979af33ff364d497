"""A step's modelled time from its optimized HLO: a per-kernel roofline.

XLA:GPU compiled without a device reports no cost analysis, so the time of a step on an H100 is
modelled here from ``compiled.as_text()``: every kernel the program launches (each instruction of
the entry computation, and of while-loop bodies times their trip count) costs

    max(bytes it reads and writes / HBM bandwidth, matmul FLOPs / the peak for their dtype) + launch

where the bytes are its operands' and outputs' (a fusion that only slices an operand reads the
slice; an in-place dynamic-update-slice writes only the update) and the FLOPs are those of the
dots and convolutions inside it (custom calls: cuBLAS GEMMs from their dimension numbers, cuDNN
convolutions from their window), counted as 2 x output elements x contracted elements.
Elementwise arithmetic and transcendentals are taken as memory-bound. Host transfers
(``copy-start`` to or from host memory) run on their own link, overlapped with the kernels: the
step is the larger of the two sums. A collective is a kernel also bounded by what each of the n
devices of its group sends over the interconnect (``link_bytes_per_s``) as a ring sends it: the whole
array x (n-1)/n (all-gather, reduce-scatter, all-to-all), twice that (all-reduce), the array
(permute); in series with the kernels (pessimistic where a device overlaps it with compute).

What the roofline does not see: occupancy and tail effects (a small kernel does not reach peak
bandwidth), overlap between kernels on different streams, caches (an operand read twice counts
twice), GEMM efficiency below peak for small or oddly shaped matrices, and the Pallas kernels'
own work beyond the bytes they move and the FLOPs their ``pl.CostEstimate`` declares. It is a
lower bound in spirit and a ranking tool in practice: compare settings on the same target.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator

import pallas_kernels
from bsr_jax.measure.hardware import H100, HARDWARE, TPU_V5P, Hardware  # noqa: F401  (roofline.H100 is read by callers)

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0,
}
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\](\{[^}]*\})?")
# Layout memory spaces: S(5) is host memory on GPU and TPU; S(1) is the TPU core's VMEM (on-chip).
_HOST_SPACE, _ONCHIP_SPACE = "S(5)", "S(1)"
# Instructions that launch nothing and move no bytes.
_FREE = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id", "replica-id",
    "opt-barrier", "add-dependency", "copy-done", "send-done", "recv-done", "all-reduce-done", "all-gather-done",
    "collective-permute-done", "reduce-scatter-done", "all-to-all-done", "async-done", "async-update", "iota",
}
# Bytes each device sends per byte of the whole array, for a group of n devices (module docstring).
_COLLECTIVES = {
    "all-gather": lambda n: (n - 1) / n, "reduce-scatter": lambda n: (n - 1) / n, "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n, "collective-permute": lambda n: 1.0,
}
_SLICING = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}




@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel's share of the modelled step: ``count`` launches (loop trips) in all."""

    name: str
    op: str  # the op_name of its metadata: module path included
    seconds: float
    bytes: float
    flops: float
    count: int


@dataclasses.dataclass(frozen=True)
class Roofline:
    """The modelled step: ``seconds`` = max(kernel time, host transfer time)."""

    seconds: float
    flops: float
    bytes: float
    kernel_seconds: float
    host_seconds: float
    kernels: tuple[Kernel, ...]  # costliest first

    def top(self, n: int = 10) -> tuple[Kernel, ...]:
        return self.kernels[:n]


@dataclasses.dataclass
class _Instr:
    name: str
    type: str
    opcode: str
    operands: list[str]
    args: str  # the text between the opcode's parentheses: a parameter's index, a constant's value
    attrs: str
    root: bool


def _matching(text: str, start: int) -> int:
    """Index just past the bracket closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO: {text[start:start + 80]!r}")


_LINE = re.compile(r"^\s*(ROOT )?%(\S+) = ")


def _parse_instr(line: str) -> _Instr | None:
    m = _LINE.match(line)
    if not m:
        return None
    i = m.end()
    end = _matching(line, i) if line[i] == "(" else line.index(" ", i)
    type_ = line[i:end]
    rest = line[end + 1 :]
    paren = rest.index("(")
    opcode = rest[:paren]
    close = _matching(rest, paren)
    operands = re.findall(r"%([\w.\-]+)", rest[paren:close])
    return _Instr(m.group(2), type_, opcode, operands, rest[paren + 1 : close - 1], rest[close:], bool(m.group(1)))


def parse_hlo(text: str) -> tuple[dict[str, list[_Instr]], str]:
    """Computations of an HLO module's text, by name, and the entry computation's name."""
    computations: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
        if header and not line.startswith(" "):
            current = computations.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and (instr := _parse_instr(line)) is not None:
            current.append(instr)
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def _arrays(type_: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    for dtype, dims, layout in _ARRAY.findall(type_):
        if dtype in _DTYPE_BYTES:
            yield dtype, tuple(int(d) for d in dims.split(",") if d), layout or ""


def type_bytes(type_: str, skip_onchip: bool = True) -> float:
    """Bytes of every array in an HLO type (tuples summed), off-chip ones only by default."""
    return sum(
        _DTYPE_BYTES[dt] * math.prod(dims) for dt, dims, layout in _arrays(type_) if not (skip_onchip and _ONCHIP_SPACE in layout)
    )


def _group_size(attrs: str) -> int:
    """Devices per replica group of a collective: ``replica_groups={{0,1,2,3}}`` or the iota form
    ``replica_groups=[2,4]<=[8]`` (2 groups of 4); a collective-permute's pairs count as 2."""
    if "source_target_pairs=" in attrs:
        return 2
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if listed:
        return len([d for d in listed.group(1).split(",") if d])
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs)
    return int(iota.group(2)) if iota else 1


def _dims(type_: str) -> tuple[int, ...]:
    return next(_arrays(type_))[1]


def _attr(attrs: str, key: str) -> str | None:
    """The value of ``key=...`` in an instruction's attributes (a ``{...}`` value whole)."""
    m = re.search(rf"\b{key}=", attrs)
    if not m:
        return None
    if attrs[m.end()] == "{":
        return attrs[m.end() : _matching(attrs, m.end())]
    return re.match(r"[^\s,]+", attrs[m.end() :]).group()


def _backend_config(attrs: str) -> dict:
    value = _attr(attrs, "backend_config")
    try:
        return json.loads(value) if value and value.startswith("{") else {}
    except ValueError:  # not JSON (some targets print a proto text)
        return {}


def _dot_flops(lhs_dims: tuple[int, ...], out_elems: int, contracting: list[int]) -> float:
    return 2.0 * out_elems * math.prod(lhs_dims[d] for d in contracting)


def _conv_flops(instr: _Instr, shapes: dict[str, str]) -> float:
    """2 x output elements x the kernel elements each output reads (rhs size over its output
    features), thinned by the lhs dilation (XLA:TPU writes batched dots as dilated convolutions:
    most of a dilated window's taps read the holes)."""
    labels = _attr(instr.attrs, "dim_labels") or ""
    rhs_labels = labels.split("_")[1].split("->")[0] if "_" in labels else ""
    rhs_dims = _dims(shapes[instr.operands[1]])
    out_features = rhs_dims[rhs_labels.index("o")] if "o" in rhs_labels else 1
    window = _attr(instr.attrs, "window") or ""
    dilation = re.search(r"lhs_dilate=([\dx]+)", window)
    thinning = math.prod(int(d) for d in dilation.group(1).split("x")) if dilation else 1
    return 2.0 * math.prod(_dims(instr.type)) * math.prod(rhs_dims) / out_features / thinning


class _Model:
    def __init__(self, text: str, hw: Hardware):
        self.computations, self.entry = parse_hlo(text)
        self.hw = hw
        self.kernels: dict[str, list] = {}
        self.host_seconds = 0.0

    def shapes(self, computation: str) -> dict[str, str]:
        return {i.name: i.type for i in self.computations[computation]}

    def product_flops(self, instr: _Instr, shapes: dict[str, str]) -> tuple[float, float]:
        """(FLOPs, seconds at peak) of one dot or convolution instruction; zeros for anything else."""
        if instr.opcode == "dot":
            contracting = [int(d) for d in re.findall(r"\d+", _attr(instr.attrs, "lhs_contracting_dims") or "")]
            f = _dot_flops(_dims(shapes[instr.operands[0]]), math.prod(_dims(instr.type)), contracting)
        elif instr.opcode == "convolution":
            f = _conv_flops(instr, shapes)
        else:
            return 0.0, 0.0
        dtype = next(_arrays(shapes[instr.operands[0]]))[0]
        return f, f / self.hw.matmul_flops.get(dtype, self.hw.default_flops)

    def matmul(self, computation: str) -> tuple[float, float]:
        """(FLOPs, seconds at peak) of the dots and convolutions in a computation and those it calls."""
        flops = seconds = 0.0
        shapes = self.shapes(computation)
        for instr in self.computations[computation]:
            f, s = self.own_matmul(instr, shapes)
            flops, seconds = flops + f, seconds + s
        return flops, seconds

    def custom_call_flops(self, instr: _Instr, shapes: dict[str, str]) -> tuple[float, float]:
        target = _attr(instr.attrs, "custom_call_target") or ""
        config = _backend_config(instr.attrs)
        out_type = instr.type.removeprefix("(")
        if "gemm_backend_config" in config or "cublas" in target:
            numbers = config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
            contracting = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
            lhs = next(_arrays(shapes[instr.operands[0]]))
            f = _dot_flops(lhs[1], math.prod(next(_arrays(out_type))[1]), contracting)
            return f, f / self.hw.matmul_flops.get(lhs[0], self.hw.default_flops)
        if "cudnn$conv" in target:
            conv = _Instr(instr.name, out_type, "convolution", instr.operands, "", instr.attrs, False)
            f = _conv_flops(conv, shapes)
            return f, f / self.hw.matmul_flops.get(next(_arrays(shapes[instr.operands[0]]))[0], self.hw.default_flops)
        kernel = re.search(r'name = "(\w+)"', instr.attrs)
        if "triton" in target and kernel and kernel.group(1) in pallas_kernels.KERNEL_FLOPS:
            # Operands (ptr, ids, values, dense): the Triton call carries no cost estimate of its own.
            values, dense = (_dims(shapes[o]) for o in instr.operands[2:4])
            f = float(pallas_kernels.KERNEL_FLOPS[kernel.group(1)](values, dense))
            return f, f / self.hw.default_flops
        # Other custom calls (Mosaic kernels on TPU carry their pl.CostEstimate to XLA): as declared.
        estimate = config.get("cost_estimate")
        f = float(estimate.get("flops", 0.0)) if isinstance(estimate, dict) else 0.0
        return f, f / self.hw.default_flops

    def io_bytes(self, instr: _Instr, shapes: dict[str, str]) -> float:
        """Bytes a kernel moves: its operands and outputs, less what a fusion never touches."""
        operand_bytes = [type_bytes(shapes[o]) for o in instr.operands]
        out_bytes = type_bytes(instr.type)
        if instr.opcode in _SLICING:  # reads what it returns (and its indices)
            return 2 * out_bytes + sum(operand_bytes[1:])
        # In place: the buffer it was given is neither read nor rewritten, only the update is written.
        if instr.opcode == "dynamic-update-slice":  # (buffer, update, *indices)
            return 2 * operand_bytes[1] + sum(operand_bytes[2:])
        if instr.opcode == "scatter":  # (buffer, indices, updates)
            return 2 * sum(operand_bytes[2:]) + operand_bytes[1]
        if instr.opcode == "custom-call" and instr.type.startswith("("):
            out_bytes = type_bytes(instr.type[1:].split("}", 1)[0] + "}")  # cuBLAS/cuDNN: the result, not the workspace
        callee = re.search(r"calls=%([\w.\-]+)", instr.attrs)
        if instr.opcode == "fusion" and callee:
            body = self.computations[callee.group(1)]
            users: dict[str, list[_Instr]] = {}
            for i in body:
                for o in i.operands:
                    users.setdefault(o, []).append(i)
            body_shapes = {i.name: i.type for i in body}
            params = {int(i.args): i for i in body if i.opcode == "parameter"}
            for k, param in params.items():
                uses = users.get(param.name, [])
                if uses and all(u.opcode in _SLICING and u.operands[0] == param.name for u in uses):
                    operand_bytes[k] = sum(type_bytes(u.type) for u in uses)
                elif uses and all(u.opcode in _IN_PLACE and u.operands[0] == param.name for u in uses):
                    # In place: the buffer is neither read nor rewritten, only the update is written.
                    update = sum(type_bytes(body_shapes[u.operands[-1 if u.opcode == "scatter" else 1]]) for u in uses)
                    operand_bytes[k] = 0.0
                    out_bytes -= type_bytes(param.type) - update
        return sum(operand_bytes) + max(out_bytes, 0.0)

    def walk(self, computation: str, times: int) -> None:
        shapes = self.shapes(computation)
        for instr in self.computations[computation]:
            op = instr.opcode
            if op in _FREE:
                continue
            if op == "while":
                trips = self.trip_count(instr)
                self.walk(_attr(instr.attrs, "body").lstrip("%"), times * trips)
                self.walk(_attr(instr.attrs, "condition").lstrip("%"), times * trips)
                continue
            if op == "call":
                self.walk(_attr(instr.attrs, "to_apply").lstrip("%"), times)
                continue
            if op == "conditional":
                branches = re.findall(r"%([\w.\-]+)", _attr(instr.attrs, "branch_computations") or "")
                if branches:  # the costliest branch
                    costs = [(self.cost_of(b), b) for b in branches]
                    self.walk(max(costs)[1], times)
                continue
            if op in ("copy-start", "copy") and any(_HOST_SPACE in t for t in [instr.type] + [shapes[o] for o in instr.operands]):
                self.host_seconds += times * type_bytes(shapes[instr.operands[0]], skip_onchip=False) / self.hw.host_bytes_per_s
                continue
            nbytes = self.io_bytes(instr, shapes)
            link_s = self.link_seconds(instr, shapes)
            if op == "custom-call":
                flops, compute_s = self.custom_call_flops(instr, shapes)
            else:
                flops, compute_s = self.own_matmul(instr, shapes)
            seconds = max(nbytes / self.hw.hbm_bytes_per_s, compute_s, link_s) + self.hw.launch_s
            meta = re.search(r'op_name="([^"]*)"', instr.attrs)
            self.kernels.setdefault(instr.name, [instr.name, meta.group(1) if meta else "", 0.0, 0.0, 0.0, 0])
            k = self.kernels[instr.name]
            k[2] += times * seconds
            k[3] += times * nbytes
            k[4] += times * flops
            k[5] += times

    def link_seconds(self, instr: _Instr, shapes: dict[str, str]) -> float:
        """Seconds a collective's bytes take over the interconnect (0 for anything else)."""
        kind = instr.opcode.removesuffix("-start")
        if kind not in _COLLECTIVES or not self.hw.link_bytes_per_s:
            return 0.0
        n = _group_size(instr.attrs)
        if n <= 1:
            return 0.0
        # The whole array: all-gather's output, the others' input (a -start's type is a tuple of both).
        arrays = [type_bytes(shapes[o]) for o in instr.operands] + [math.prod(dims) * _DTYPE_BYTES[dtype] for dtype, dims, _ in _arrays(instr.type)]
        return max(arrays) * _COLLECTIVES[kind](n) / self.hw.link_bytes_per_s

    def own_matmul(self, instr: _Instr, shapes: dict[str, str]) -> tuple[float, float]:
        """(FLOPs, seconds at peak) of one kernel: a bare dot/convolution or what its callees compute."""
        flops, seconds = self.product_flops(instr, shapes)
        for callee in re.findall(r"calls=%([\w.\-]+)", instr.attrs):
            f, s = self.matmul(callee)
            flops, seconds = flops + f, seconds + s
        return flops, seconds

    def cost_of(self, computation: str) -> float:
        saved, self.kernels = self.kernels, {}
        self.walk(computation, 1)
        total = sum(k[2] for k in self.kernels.values())
        self.kernels = saved
        return total

    def trip_count(self, instr: _Instr) -> int:
        known = _backend_config(instr.attrs).get("known_trip_count", {}).get("n")
        if known is not None:
            return int(known)
        # XLA:TPU does not annotate the count: read `i < N` off the condition (from 0, step 1).
        cond = _attr(instr.attrs, "condition").lstrip("%")
        body = self.computations[cond]
        constants = {i.name: int(i.args) for i in body if i.opcode == "constant" and re.fullmatch(r"-?\d+", i.args)}
        for i in body:
            if i.root and i.opcode == "compare" and "direction=LT" in i.attrs:
                found = [constants[o] for o in i.operands if o in constants]
                if found:
                    return max(found[0], 1)
        return 1


def roofline(hlo_text: str, hardware: Hardware | str) -> Roofline:
    """The modelled step time of an optimized HLO module (``compiled.as_text()``) on ``hardware``
    (a ``Hardware`` or a name of ``HARDWARE``: ``"h100"``, ``"tpu-v5p"``)."""
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    model = _Model(hlo_text, hw)
    model.walk(model.entry, 1)
    kernels = sorted((Kernel(*k) for k in model.kernels.values()), key=lambda k: -k.seconds)
    kernel_seconds = sum(k.seconds for k in kernels)
    return Roofline(
        seconds=max(kernel_seconds, model.host_seconds),
        flops=sum(k.flops for k in kernels),
        bytes=sum(k.bytes for k in kernels),
        kernel_seconds=kernel_seconds,
        host_seconds=model.host_seconds,
        kernels=tuple(kernels),
    )
