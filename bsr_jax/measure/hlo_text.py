"""XLA's HLO module text, read: computations of instructions, array types and their bytes, attributes.

What ``bsr_jax.measure.roofline`` models a step's time from; nothing here knows about costs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator

DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0,
}
ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\](\{[^}]*\})?")
# Layout memory spaces: S(5) is host memory on GPU and TPU; S(1) is the TPU core's VMEM (on-chip).
HOST_SPACE, ONCHIP_SPACE = "S(5)", "S(1)"


@dataclasses.dataclass
class Instr:
    name: str
    type: str
    opcode: str
    operands: list[str]
    args: str  # the text between the opcode's parentheses: a parameter's index, a constant's value
    attrs: str
    root: bool


def matching(text: str, start: int) -> int:
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


LINE = re.compile(r"^\s*(ROOT )?%(\S+) = ")


def parse_instr(line: str) -> Instr | None:
    m = LINE.match(line)
    if not m:
        return None
    i = m.end()
    end = matching(line, i) if line[i] == "(" else line.index(" ", i)
    type_ = line[i:end]
    rest = line[end + 1 :]
    paren = rest.index("(")
    opcode = rest[:paren]
    close = matching(rest, paren)
    operands = re.findall(r"%([\w.\-]+)", rest[paren:close])
    return Instr(m.group(2), type_, opcode, operands, rest[paren + 1 : close - 1], rest[close:], bool(m.group(1)))


def _logical_lines(text: str) -> Iterator[str]:
    """The text's lines, an instruction whose attributes run over several lines joined into one
    (Mosaic kernels' ``frontend_attributes={kernel_metadata={...}}`` hold a JSON with line breaks:
    a continuation line starting with ``}}`` read as the computation's end hid every instruction
    after Pallas splash attention's forward kernel)."""
    pending = ""
    for line in text.splitlines():
        if pending:
            pending += line
        elif line.startswith(" ") and line.endswith("{"):  # an attribute opened at the line's end
            pending = line
        else:
            yield line
            continue
        if pending.count("{") <= pending.count("}"):
            yield pending
            pending = ""
    if pending:
        yield pending


def parse_hlo(text: str) -> tuple[dict[str, list[Instr]], str]:
    """Computations of an HLO module's text, by name, and the entry computation's name."""
    computations: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in _logical_lines(text):
        header = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
        if header and not line.startswith(" "):
            current = computations.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and (instr := parse_instr(line)) is not None:
            current.append(instr)
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def arrays(type_: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    for dtype, dims, layout in ARRAY.findall(type_):
        if dtype in DTYPE_BYTES:
            yield dtype, tuple(int(d) for d in dims.split(",") if d), layout or ""


def type_bytes(type_: str, skip_onchip: bool = True) -> float:
    """Bytes of every array in an HLO type (tuples summed), off-chip ones only by default."""
    return sum(
        DTYPE_BYTES[dt] * math.prod(dims) for dt, dims, layout in arrays(type_) if not (skip_onchip and ONCHIP_SPACE in layout)
    )


def dims(type_: str) -> tuple[int, ...]:
    return next(arrays(type_))[1]


def attr(attrs: str, key: str) -> str | None:
    """The value of ``key=...`` in an instruction's attributes (a ``{...}`` value whole)."""
    m = re.search(rf"\b{key}=", attrs)
    if not m:
        return None
    if attrs[m.end()] == "{":
        return attrs[m.end() : matching(attrs, m.end())]
    return re.match(r"[^\s,]+", attrs[m.end() :]).group()


def backend_config(attrs: str) -> dict:
    value = attr(attrs, "backend_config")
    try:
        return json.loads(value) if value and value.startswith("{") else {}
    except ValueError:  # not JSON (some targets print a proto text)
        return {}


def cost_estimate(config: dict) -> dict:
    """A custom call's declared ``pl.CostEstimate`` from its ``backend_config`` (Mosaic kernels on
    TPU: in their ``custom_call_config``, numbers as strings), or {}."""
    estimate = config.get("cost_estimate") or config.get("custom_call_config", {}).get("cost_estimate")
    return estimate if isinstance(estimate, dict) else {}


def op_names(computations: dict[str, list[Instr]]) -> dict[str, str]:
    """Instruction name -> the ``op_name`` of its metadata (the JAX name stack: module path
    included). A fusion or call XLA built without one takes that of the last instruction of the
    computation it calls that has one (its root, where named), so that every kernel of a program
    (``fusion.926``) can be told apart by the module that produced it; a copy XLA inserted without
    one (host offload's ``copy-start``) takes its operand's."""
    names = {i.name: m.group(1) for instrs in computations.values() for i in instrs if (m := re.search(r'op_name="([^"]*)"', i.attrs))}
    for instrs in computations.values():
        for i in instrs:
            if i.name not in names:
                for callee in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", i.attrs):
                    named = [names[j.name] for j in computations.get(callee, ()) if j.name in names]
                    if named:
                        names[i.name] = named[-1]
                        break
            # A copy XLA inserted (host offload's copy-start/-done) moves what its operand's op made.
            if i.name not in names and i.opcode in MOVES and i.operands and i.operands[0] in names:
                names[i.name] = names[i.operands[0]]
    return names


MOVES = {"copy", "copy-start", "copy-done", "bitcast", "get-tuple-element"}  # instructions that pass their operand on


def group_size(attrs: str) -> int:
    """Devices per replica group of a collective: ``replica_groups={{0,1,2,3}}``, the iota form
    ``replica_groups=[2,4]<=[8]`` (2 groups of 4), or the mesh form XLA writes for jit's SPMD
    programs, ``replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}`` (the product of the
    named axes' sizes); a collective-permute's pairs count as 2."""
    if "source_target_pairs=" in attrs:
        return 2
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if listed:
        return len([d for d in listed.group(1).split(",") if d])
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs)
    if iota:
        return int(iota.group(2))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if mesh:
        sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        return math.prod(sizes[name] for name in re.findall(r"'([^']+)'", mesh.group(2)))
    if "replica_groups=mesh" in attrs:
        raise ValueError(f"unrecognised replica groups: {attrs[:200]}")
    return 1
