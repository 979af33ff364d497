"""A step's modelled time from its optimized HLO: a per-kernel roofline.

XLA:GPU compiled without a device reports no cost analysis, so the time of a step on an H100 is
modelled here from ``compiled.as_text()``: every kernel the program launches (each instruction of
the entry computation, and of while-loop bodies times their trip count) costs

    max(bytes it reads and writes / HBM bandwidth, matmul FLOPs / the peak for their dtype) + launch

where the bytes are its operands' and outputs' (a fusion that only slices an operand reads the
slice; an in-place dynamic-update-slice writes only the update) and the FLOPs are those of the
dots and convolutions inside it (custom calls: cuBLAS GEMMs from their dimension numbers, cuDNN
convolutions from their window, cuDNN flash attention from its scores' shape), counted as
2 x output elements x contracted elements.
Elementwise arithmetic and transcendentals are taken as memory-bound. Host transfers
(``copy-start`` to or from host memory) run on their own link, overlapped with the kernels: the
step is the larger of the two sums. A collective is a kernel also bounded by what each of the n
devices of its group sends over the interconnect (``link_bytes_per_s``) as a ring sends it: the whole
array x (n-1)/n (all-gather, reduce-scatter, all-to-all), twice that (all-reduce), the array
(permute); in series with the kernels (pessimistic where a device overlaps it with compute).

Our own Triton kernels are priced as ``bsr_jax.measure.pallas_cost`` says (whole waves of their grid
over the GPU's SMs, at the share of peak they were measured to reach).
What the roofline does not see: occupancy and tail effects of XLA's kernels (a small kernel does not reach peak
bandwidth), overlap between kernels on different streams, caches (an operand read twice counts
twice), GEMM efficiency below peak for small or oddly shaped matrices, and the Pallas kernels'
own work beyond the bytes they move and the FLOPs their ``pl.CostEstimate`` declares. It is a
lower bound in spirit and a ranking tool in practice: compare settings on the same target.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from bsr_jax.measure import pallas_cost
from bsr_jax.measure.hardware import H100, HARDWARE, TPU_V5P, Hardware  # noqa: F401  (roofline.H100 is read by callers)
from bsr_jax.measure.hlo_text import (
    HOST_SPACE,
    MOVES,
    Instr,
    arrays,
    attr,
    backend_config,
    cost_estimate,
    dims,
    group_size,
    op_names,
    parse_hlo,
    type_bytes,
)

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
    transfers: tuple[Kernel, ...] = ()  # host copies (their time is ``host_seconds``'), costliest first
    # The same program with every while-loop body counted once, whatever its trip count, as
    # XLA:TPU's cost model counts it (``bsr_jax.compiled_memory`` scales that model by their ratio).
    seconds_loops_once: float = 0.0
    # Kernels whose cost XLA's model cannot see (Pallas splash attention: a Mosaic call without a
    # cost estimate), loops counted: what ``bsr_jax.compiled_memory`` adds to XLA:TPU's time.
    uncosted_seconds: float = 0.0

    def top(self, n: int = 10) -> tuple[Kernel, ...]:
        return self.kernels[:n]


# Pallas splash attention's kernels by name, and the products each computes over the scores.
_SPLASH = re.compile(r"splash_m[hq]a_(fwd|dq|dkv)")
_SPLASH_PRODUCTS = {"fwd": 2, "dq": 3, "dkv": 4}


def _dot_flops(lhs_dims: tuple[int, ...], out_elems: int, contracting: list[int]) -> float:
    return 2.0 * out_elems * math.prod(lhs_dims[d] for d in contracting)


def _attention_flops(config: dict, q_dims: tuple[int, ...], backward: bool) -> float:
    """cuDNN flash attention's matmul FLOPs (XLA's cost model counts none): the forward's two
    products (q k^T, p v) over its ``(B, heads, Tq, Tk)`` scores, the backward's five (the scores
    recomputed, dv, dp, dq, dk), each 2 x B x heads x Tq x Tk x head_dim; a causal mask skips half."""
    scores = math.prod(int(d) for d in config.get("intermediate_tensor_shape", {}).get("dimensions", []))
    products = 5 if backward else 2
    return products * 2.0 * scores * q_dims[-1] * (0.5 if config.get("mask_type") == "CAUSAL" else 1.0)


def _valid_taps(out: int, size: int, window: int, stride: int, pad_lo: int, lhs_dilate: int, rhs_dilate: int) -> int:
    """(output position, window tap) pairs of one spatial dimension whose tap reads the input, not
    its padding or the holes of its dilation."""
    o = np.arange(out)[:, None] * stride + np.arange(window)[None, :] * rhs_dilate - pad_lo
    return int(np.count_nonzero((o >= 0) & (o <= (size - 1) * lhs_dilate) & (o % lhs_dilate == 0)))


def _conv_flops(instr: Instr, shapes: dict[str, str]) -> float:
    """2 x output elements x the kernel elements each output reads (rhs size over its output
    features), thinned to the window taps that read the input: XLA:TPU writes batched dots as
    convolutions whose lhs is dilated as wide as the window, and projections as a window sliding
    over a padded spatial dimension of size 1; most of their taps read holes or padding."""
    labels = attr(instr.attrs, "dim_labels") or ""
    lhs_labels, rhs_labels = (labels.split("->")[0].split("_") + ["", ""])[:2]
    out_labels = labels.split("->")[1] if "->" in labels else ""
    lhs_dims, rhs_dims, out_dims = dims(shapes[instr.operands[0]]), dims(shapes[instr.operands[1]]), dims(instr.type)
    out_features = rhs_dims[rhs_labels.index("o")] if "o" in rhs_labels else 1
    dense = 2.0 * math.prod(out_dims) * math.prod(rhs_dims) / out_features
    window = dict(re.findall(r"(\w+)=([\d_x]+)", attr(instr.attrs, "window") or ""))
    if "size" not in window:
        return dense
    sizes = [int(w) for w in window["size"].split("x")]
    per_dim = lambda key, default: [p for p in window[key].split("x")] if key in window else [default] * len(sizes)
    fraction = 1.0
    for i, (w, stride, pad, ld, rd) in enumerate(zip(sizes, per_dim("stride", "1"), per_dim("pad", "0_0"), per_dim("lhs_dilate", "1"),
                                                        per_dim("rhs_dilate", "1"))):  # fmt: skip
        digit = str(i)
        if digit not in lhs_labels or digit not in out_labels:
            continue
        out = out_dims[out_labels.index(digit)]
        taps = _valid_taps(out, lhs_dims[lhs_labels.index(digit)], w, int(stride), int(pad.split("_")[0]), int(ld), int(rd))
        fraction *= taps / (out * w)
    return dense * fraction


class _Model:
    def __init__(self, text: str, hw: Hardware):
        self.computations, self.entry = parse_hlo(text)
        self.instrs = {i.name: i for instrs in self.computations.values() for i in instrs}  # names are unique in a module
        self.hw = hw
        self.names = op_names(self.computations)
        self.kernels: dict[str, list] = {}
        self.transfers: dict[str, list] = {}  # host copies, as kernels of the host link
        self.host_seconds = 0.0
        # The same sums with every while body counted once, as XLA:TPU's cost model counts it.
        self.kernel_seconds_once = self.host_seconds_once = 0.0

    def shapes(self, computation: str) -> dict[str, str]:
        return {i.name: i.type for i in self.computations[computation]}

    def product_flops(self, instr: Instr, shapes: dict[str, str]) -> tuple[float, float]:
        """(FLOPs, seconds at peak) of one dot or convolution instruction; zeros for anything else."""
        if instr.opcode == "dot":
            contracting = [int(d) for d in re.findall(r"\d+", attr(instr.attrs, "lhs_contracting_dims") or "")]
            f = _dot_flops(dims(shapes[instr.operands[0]]), math.prod(dims(instr.type)), contracting)
        elif instr.opcode == "convolution":
            f = _conv_flops(instr, shapes)
        else:
            return 0.0, 0.0
        return self.at_peak(f, instr, shapes)

    def at_peak(self, flops: float, instr: Instr, shapes: dict[str, str]) -> tuple[float, float]:
        """(FLOPs, seconds at the matmul peak for the dtype of ``instr``'s first operand)."""
        return flops, flops / self.hw.matmul_flops.get(next(arrays(shapes[instr.operands[0]]))[0], self.hw.default_flops)

    def matmul(self, computation: str) -> tuple[float, float]:
        """(FLOPs, seconds at peak) of the dots and convolutions in a computation and those it calls."""
        flops = seconds = 0.0
        shapes = self.shapes(computation)
        for instr in self.computations[computation]:
            f, s = self.own_matmul(instr, shapes)
            flops, seconds = flops + f, seconds + s
        return flops, seconds

    def custom_call_flops(self, instr: Instr, shapes: dict[str, str], config: dict, ours: str | None) -> tuple[float, float]:
        """(FLOPs, seconds at peak) of a custom call; ``config``: its parsed ``backend_config``;
        ``ours``: the ``pallas_kernels`` kernel it runs (``pallas_cost.kernel``), if one."""
        target = attr(instr.attrs, "custom_call_target") or ""
        out_type = instr.type.removeprefix("(")
        if "gemm_backend_config" in config or "cublas" in target:
            numbers = config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
            contracting = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
            f = _dot_flops(dims(shapes[instr.operands[0]]), math.prod(next(arrays(out_type))[1]), contracting)
            return self.at_peak(f, instr, shapes)
        if "cudnn$conv" in target:
            conv = Instr(instr.name, out_type, "convolution", instr.operands, "", instr.attrs, False)
            return self.at_peak(_conv_flops(conv, shapes), instr, shapes)
        if "cudnn$fmha" in target:
            f = _attention_flops(config.get("cudnn_fmha_backend_config", {}), dims(shapes[instr.operands[0]]), "Backward" in target)
            return self.at_peak(f, instr, shapes)
        if ours:
            return pallas_cost.flops(ours, instr, shapes, self.hw)
        splash = _SPLASH.match(instr.name)
        if splash and "tpu_custom_call" in target:
            return self.splash_flops(instr, shapes, splash.group(1))
        # Other custom calls: as declared. Mosaic kernels on TPU carry their pl.CostEstimate to XLA in
        # their custom_call_config, its numbers as strings.
        f = float(cost_estimate(config).get("flops", 0.0))
        return f, f / self.hw.default_flops

    def splash_flops(self, instr: Instr, shapes: dict[str, str], phase: str) -> tuple[float, float]:
        """(FLOPs, seconds at peak) of a Pallas splash attention kernel (``jax.experimental.pallas.ops.tpu.
        splash_attention``), which carries no cost estimate: its products (forward 2: ``q k^T``, ``p v``;
        dq 3; dkv 4, the scores recomputed in each) of 2 x (q's rows) x (k's rows) x head_dim, times the
        share of its block mask's blocks it computes (a causal mask about half), read from the mask's
        constant where the kernel's operand leads to one; the whole grid where it does not."""
        floats = [o for o in instr.operands if next(arrays(shapes[o]), ("",))[0] in ("bf16", "f16", "f32")]
        q, k = dims(shapes[floats[0]]), dims(shapes[floats[1]])
        masks = [o for o in instr.operands if next(arrays(shapes[o]), ("",))[0] in ("s8", "s16", "s32", "u8")]
        share = self.constant_share(masks[1]) if len(masks) > 1 else 1.0  # (data_next, block_mask, ...): splash's order
        flops = _SPLASH_PRODUCTS[phase] * 2.0 * math.prod(q[:-1]) * k[-2] * q[-1] * share
        dtype = next(arrays(shapes[floats[0]]))[0]
        return flops, flops / self.hw.matmul_flops.get(dtype, self.hw.default_flops)

    def constant_share(self, name: str) -> float:
        """The share of nonzero values of the constant ``name`` is (through copies and bitcasts), or 1."""
        instr = self.instrs.get(name)
        while instr is not None and instr.opcode in MOVES and instr.operands:
            instr = self.instrs.get(instr.operands[0])
        values = [int(v) for v in re.findall(r"-?\d+", instr.args)] if instr is not None and instr.opcode == "constant" else []
        return sum(v != 0 for v in values) / len(values) if values else 1.0

    def io_bytes(self, instr: Instr, shapes: dict[str, str]) -> float:
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
        library_call = re.search(r"cublas|cudnn", attr(instr.attrs, "custom_call_target") or "")
        if instr.opcode == "custom-call" and instr.type.startswith("(") and library_call:
            out_bytes = type_bytes(instr.type[1:].split("}", 1)[0] + "}")  # cuBLAS/cuDNN: the result, not the workspace
        callee = re.search(r"calls=%([\w.\-]+)", instr.attrs)
        if instr.opcode == "fusion" and callee:
            body = self.computations[callee.group(1)]
            users: dict[str, list[Instr]] = {}
            for i in body:
                for o in i.operands:
                    users.setdefault(o, []).append(i)
            body_shapes = {i.name: i.type for i in body}
            params = {int(i.args): i for i in body if i.opcode == "parameter"}

            def readers(name: str) -> list[tuple[Instr, str]]:  # (instruction, the view it reads): bitcasts are views
                return [r for u in users.get(name, []) for r in (readers(u.name) if u.opcode == "bitcast" else [(u, name)])]

            for k, param in params.items():
                uses = readers(param.name)
                if uses and all(u.opcode in _SLICING and u.operands[0] == view for u, view in uses):
                    operand_bytes[k] = sum(type_bytes(u.type) for u, _ in uses)
                elif uses and all(u.opcode in _IN_PLACE and u.operands[0] == view for u, view in uses):
                    # In place (a scanned layer's slice written into its stack, through a bitcast or not):
                    # the buffer is neither read nor rewritten, only the update is written.
                    update = sum(type_bytes(body_shapes[u.operands[-1 if u.opcode == "scatter" else 1]]) for u, _ in uses)
                    operand_bytes[k] = 0.0
                    out_bytes -= type_bytes(param.type) - update
        return sum(operand_bytes) + max(out_bytes, 0.0)

    def walk(self, computation: str, times: int, once: int = 1) -> None:
        """Add the computation's kernels, run ``times`` times (``once``: its loops' bodies counted once)."""
        shapes = self.shapes(computation)
        for instr in self.computations[computation]:
            op = instr.opcode
            if op in _FREE:
                continue
            if op == "while":
                trips = self.trip_count(instr)
                self.walk(attr(instr.attrs, "body").lstrip("%"), times * trips, once)
                self.walk(attr(instr.attrs, "condition").lstrip("%"), times * trips, once)
                continue
            if op == "call":
                self.walk(attr(instr.attrs, "to_apply").lstrip("%"), times, once)
                continue
            if op == "conditional":
                branches = re.findall(r"%([\w.\-]+)", attr(instr.attrs, "branch_computations") or "")
                if branches:  # the costliest branch
                    costs = [(self.cost_of(b), b) for b in branches]
                    self.walk(max(costs)[1], times, once)
                continue
            if op in ("copy-start", "copy") and any(HOST_SPACE in t for t in [instr.type] + [shapes[o] for o in instr.operands]):
                nbytes = type_bytes(shapes[instr.operands[0]], skip_onchip=False)
                seconds = nbytes / self.hw.host_bytes_per_s
                self.host_seconds += times * seconds
                self.host_seconds_once += once * seconds
                self.add(self.transfers, instr, times * seconds, times * nbytes, 0.0, times)
                continue
            nbytes = self.io_bytes(instr, shapes)
            link_s = self.link_seconds(instr, shapes)
            if op == "custom-call":
                config = backend_config(instr.attrs)  # parsed once: a Mosaic call's holds its whole kernel
                ours = pallas_cost.kernel(instr)
                flops, compute_s = self.custom_call_flops(instr, shapes, config, ours)
                # A kernel's declared traffic counts where it re-reads its operands (a GEMM's tiles).
                nbytes = max(nbytes, float(cost_estimate(config).get("bytes_accessed", 0.0)))
            else:
                flops, compute_s = self.own_matmul(instr, shapes)
                ours = None
            slow = pallas_cost.slowdown(ours, instr, shapes, self.hw) if ours else 1.0
            seconds = max(nbytes / self.hw.hbm_bytes_per_s, compute_s, link_s) * slow + self.hw.launch_s
            self.add(self.kernels, instr, times * seconds, times * nbytes, times * flops, times)
            self.kernel_seconds_once += once * seconds

    def add(self, into: dict[str, list], instr: Instr, seconds: float, nbytes: float, flops: float, count: int) -> None:
        k = into.setdefault(instr.name, [instr.name, self.names.get(instr.name, ""), 0.0, 0.0, 0.0, 0])
        k[2] += seconds
        k[3] += nbytes
        k[4] += flops
        k[5] += count

    def link_seconds(self, instr: Instr, shapes: dict[str, str]) -> float:
        """Seconds a collective's bytes take over the interconnect (0 for anything else)."""
        kind = instr.opcode.removesuffix("-start")
        if kind not in _COLLECTIVES or not self.hw.link_bytes_per_s:
            return 0.0
        n = group_size(instr.attrs)
        if n <= 1:
            return 0.0
        # The whole arrays: the operands (an all-gather's are its shards, n of them each), summed:
        # XLA's combiners make one collective of several arrays.
        whole = sum(type_bytes(shapes[o]) for o in instr.operands) * (n if kind == "all-gather" else 1)
        return whole * _COLLECTIVES[kind](n) / self.hw.link_bytes_per_s

    def own_matmul(self, instr: Instr, shapes: dict[str, str]) -> tuple[float, float]:
        """(FLOPs, seconds at peak) of one kernel: a bare dot/convolution or what its callees compute."""
        flops, seconds = self.product_flops(instr, shapes)
        for callee in re.findall(r"calls=%([\w.\-]+)", instr.attrs):
            f, s = self.matmul(callee)
            flops, seconds = flops + f, seconds + s
        return flops, seconds

    def cost_of(self, computation: str) -> float:
        # A trial walk: whatever it adds (host copies included) is put back as it was.
        saved = self.kernels, self.transfers, self.kernel_seconds_once, self.host_seconds, self.host_seconds_once
        self.kernels, self.transfers = {}, {}
        self.walk(computation, 1)
        total = sum(k[2] for k in self.kernels.values())
        self.kernels, self.transfers, self.kernel_seconds_once, self.host_seconds, self.host_seconds_once = saved
        return total

    def trip_count(self, instr: Instr) -> int:
        known = backend_config(instr.attrs).get("known_trip_count", {}).get("n")
        if known is not None:
            return int(known)
        # XLA:TPU does not annotate the count: read `i < N` off the condition (from 0, step 1).
        cond = attr(instr.attrs, "condition").lstrip("%")
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
        transfers=tuple(sorted((Kernel(*k) for k in model.transfers.values()), key=lambda k: -k.seconds)),
        seconds_loops_once=max(model.kernel_seconds_once, model.host_seconds_once),
        uncosted_seconds=sum(k.seconds for k in kernels if _SPLASH.match(k.name)),
    )
