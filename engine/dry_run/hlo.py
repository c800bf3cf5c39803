"""Reading what libtpu and XLA leave behind for ``engine.dry_run.estimate``: libtpu's static
profile (protobuf text format, ``*_static_llo_profile.textproto``) and the text of a compiled
HLO module (computations, ``while`` trip counts, collectives and the bytes each chip sends,
per-op HBM bytes, matmul FLOPs). Pure text parsing: nothing here compiles or knows a chip.
"""

from __future__ import annotations

import glob
import math
import os
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1,
                "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
                "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}


def parse_textproto(text: str) -> dict:
    """A protobuf text-format message as {field: [values]}; nested messages are dicts.

    Scalars stay strings (quotes removed); enough for the static-profile files, which hold
    no comments, maps or escaped quotes inside strings.
    """
    tokens = re.findall(r'"(?:[^"\\]|\\.)*"|[{}]|[^\s{}:]+:?', text)
    stack, out, key = [], {}, None
    for tok in tokens:
        if tok == "{":
            child = {}
            out.setdefault(key, []).append(child)
            stack.append(out)
            out, key = child, None
        elif tok == "}":
            out = stack.pop()
        elif key is None:
            key = tok.rstrip(":")
        else:
            out.setdefault(key, []).append(tok[1:-1] if tok.startswith('"') else tok)
            key = None
    return out


def profile_ops(text: str) -> list[dict]:
    """The ``hlo_op_estimate`` entries of one profile file: {name, cycles}. (Some entries
    also describe the instruction; not all do, so bytes come from the HLO text.)"""
    return [dict(name=est["hlo_op_name"][0], cycles=int(est["estimated_cycles"][0]))
            for est in parse_textproto(text).get("hlo_op_estimate", [])]


def read_profile(profile_dir: str) -> list[dict]:
    """Every op of every ``*_static_llo_profile.textproto`` in ``profile_dir``."""
    ops = []
    for path in sorted(glob.glob(os.path.join(profile_dir, "*_static_llo_profile.textproto"))):
        with open(path) as f:
            ops += profile_ops(f.read())
    return ops


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")


def hlo_computations(hlo_text: str) -> dict:
    """{computation: [(name, result type, opcode, rest of line)]} of an HLO module's text;
    the entry computation is also under the key "ENTRY"."""
    comps, current = {}, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = comps.setdefault(m.group(1), [])
            if line.startswith("ENTRY"):
                comps["ENTRY"] = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line) if current is not None else None
        if m:
            current.append(m.groups())
    return comps


def _trip_count(rest: str, comps: dict) -> int:
    """A while loop's trip count: XLA's ``known_trip_count``, else the bound its condition
    compares the counter against (``lax.scan``/``fori_loop`` count from 0, step 1)."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
    if m:
        return int(m.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", rest)
    for _, _, opcode, args in comps.get(cond.group(1) if cond else "", []):
        if opcode == "constant":
            m = re.match(r"(\d+)\)", args)
            if m:
                return int(m.group(1))
    return 1


def hlo_multipliers(hlo_text: str) -> dict:
    """{instruction name: how many times it runs per program call}: x the trip count of
    every ``while`` it sits in; everything else 1."""
    comps = hlo_computations(hlo_text)
    times, todo = {"ENTRY": 1}, ["ENTRY"]
    while todo:
        comp = todo.pop()
        for _, _, opcode, rest in comps.get(comp, []):
            calls = re.findall(r"(?:body|condition|calls|to_apply|branch_computations)="
                               r"\{?%?([\w.\-]+)", rest)
            factor = _trip_count(rest, comps) if opcode == "while" else 1
            for callee in calls:
                if callee in comps and callee not in times:
                    times[callee] = times[comp] * factor
                    todo.append(callee)
    return {name: times.get(comp, 1) for comp, insts in comps.items() if comp != "ENTRY"
            for name, *_ in insts}


def _type_bytes(text: str, *, hbm_only: bool = False) -> float:
    """Bytes of every array type such as ``bf16[2,128]{1,0}`` in ``text``.

    ``hbm_only``: skip arrays whose layout names an on-chip memory space (``S(1)``, VMEM,
    where XLA's memory-space assignment prefetches weights and keeps small buffers;
    ``S(2)``, SMEM): reading or writing them is no HBM traffic."""
    total = 0.0
    for dtype, dims, layout in re.findall(
            r"\b([a-z]+\d*(?:e\dm\d(?:fn)?)?)\[([\d,]*)\](\{[^}]*\})?", text):
        if dtype in _DTYPE_BYTES and not (hbm_only and re.search(r"S\([1-9]", layout)):
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _operand_list(rest: str) -> str:
    """The operand list of an instruction, from the text after its opening parenthesis
    (attributes such as backend_config follow the closing one)."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i]
    return rest


def _group_size(rest: str) -> int:
    """Devices per replica group: ``{{0,1,2,3},...}``, iota ``[2,4]<=[8]`` or the mesh form
    ``mesh['a'=2,'b'=4] {'b'}``, also with a non-iota device order
    (``mesh['a'=2,'b'=4], device_ids=(...) {'b'}``, which XLA prints between the axes and
    the group) and sub-axes (``{'a':(1)2}``: 2 devices of axis a)."""
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", rest)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(.*?\))?\s*\{([^}]*)\}",
                  rest)
    if m:
        sizes = {a: int(n) for a, n in re.findall(r"'?(\w+)'?=(\d+)", m.group(1))}
        n = 1
        for axis, sub in re.findall(r"'?(\w+)'?(?::\(\d+\)(\d+))?", m.group(2)):
            n *= int(sub) if sub else sizes[axis]
        return n
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
    return 2 if m else 1


def collectives(hlo_text: str) -> list[dict]:
    """The collectives of a compiled (SPMD-partitioned) HLO module, per chip per call.

    Returns dicts: kind, name, group (devices per group), count (x while trip counts),
    operand_bytes and result_bytes (per-device shapes), sent_bytes (what one chip sends by
    a ring algorithm; see ``engine.dry_run.estimate``'s docstring). An all-reduce whose
    computation keeps only a dynamic-slice of it (libtpu's all-reduce-scatter fusion)
    counts as a reduce-scatter.
    """
    comps = hlo_computations(hlo_text)
    times = hlo_multipliers(hlo_text)
    out = []
    for comp, insts in comps.items():
        if comp == "ENTRY":
            continue
        root_slices = any(op == "dynamic-slice" and re.search(r"%?all-reduce[\w.\-]*\W", rest)
                          for _, _, op, rest in insts)
        types = {name: result for name, result, _, _ in insts}
        for name, result, opcode, rest in insts:
            kind = opcode.removesuffix("-start")
            if kind not in COLLECTIVES:
                continue
            operand = sum(_type_bytes(types.get(o, ""))
                          for o in re.findall(r"%([\w.\-]+)", _operand_list(rest)))
            res = _result_bytes(opcode, result, operand)
            n = _group_size(rest)
            if kind == "all-reduce" and root_slices:
                kind = "reduce-scatter"
            sent = {"all-reduce": 2 * (n - 1) / n * operand,
                    "reduce-scatter": (n - 1) / n * operand,
                    "all-gather": (n - 1) / n * res,
                    "all-to-all": (n - 1) / n * operand,
                    "collective-permute": operand}[kind]
            out.append(dict(kind=kind, name=name, group=n, count=times.get(name, 1),
                            operand_bytes=operand, result_bytes=res,
                            sent_bytes=sent if n > 1 else 0.0))
    return out


def _result_bytes(opcode: str, result: str, operand_bytes: float) -> float:
    """Bytes of what an op produces. An async ``*-start``'s result is a tuple that holds its
    operands again (aliased) beside the new buffer: only the part beyond them is new."""
    res = _type_bytes(result)
    if opcode.endswith("-start") and res > operand_bytes:
        res -= operand_bytes
    return res


def hlo_op_bytes(hlo_text: str) -> dict:
    """{instruction name: (opcode, HBM bytes of its operands and result)}: the HBM traffic of
    each op if nothing else stays on chip (per-device shapes; tile padding and in-fusion
    slicing not modelled, so a fused dynamic-slice counts its whole operand).

    Arrays that XLA placed in on-chip memory (``S(1)``/``S(2)`` layouts) are not counted. An
    async ``*-start`` (``copy-start``; ``async-start`` of a slice: XLA's memory-space
    assignment prefetching a weight into VMEM in slices) moves its payload once: its result
    tuple holds the operand again (aliased), so its bytes are the result's minus the
    operands'. Counting them whole charged a 52 MB weight prefetched in 13 slices as 1.4 GB
    (Wan 14B, one dp2 x sp4 block on v6e: 80 slice-starts, 8.7 GB charged for 0.3 GB moved).
    """
    out = {}
    for insts in hlo_computations(hlo_text).values():
        types = {name: result for name, result, _, _ in insts}
        for name, result, opcode, rest in insts:
            operands = [types.get(o, "") for o in re.findall(r"%([\w.\-]+)",
                                                               _operand_list(rest))]
            if opcode.endswith("-start"):
                out[name] = (opcode, _result_bytes(opcode, result,
                                                   sum(_type_bytes(t) for t in operands)))
                continue
            out[name] = (opcode, _type_bytes(result, hbm_only=True) + sum(
                _type_bytes(t, hbm_only=True) for t in operands))
    return out


def _dims(type_text: str) -> list[int]:
    m = re.search(r"\[([\d,]*)\]", type_text or "")
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def instruction_flops(types: dict, result: str, opcode: str, rest: str) -> float:
    """FLOPs (2 per multiply-add) of a convolution or dot instruction: 2 x output elements
    x contraction size; 0 for anything else.

    A convolution's contraction is its input features (the rhs ``i`` dimension) times the
    real taps of its window: per spatial dimension ``ceil(size / lhs_dilate)``, since an
    lhs-dilated input holds ``lhs_dilate - 1`` zeros between real elements. XLA lowers a
    batched dot as such a convolution (``window={size=W stride=W-1 lhs_dilate=W}``, the
    batch as a spatial dimension): one real tap per output, not W.
    """
    operands = re.findall(r"%([\w.\-]+)", _operand_list(rest))
    out = math.prod(_dims(result))
    if opcode == "convolution" and len(operands) == 2:
        rhs = _dims(types.get(operands[1]))
        labels = re.search(r"dim_labels=\w+_(\w+)->", rest)
        i = labels.group(1).find("i") if labels else -1
        if not rhs or not 0 <= i < len(rhs):
            return 0.0
        spatial = [rhs[k] for k, c in enumerate(labels.group(1)) if c.isdigit()]
        window = re.search(r"window=\{([^}]*)\}", rest)
        size = re.search(r"size=([\dx]+)", window.group(1)) if window else None
        dilate = re.search(r"lhs_dilate=([\dx]+)", window.group(1)) if window else None
        sizes = [int(d) for d in size.group(1).split("x")] if size else spatial
        dilates = ([int(d) for d in dilate.group(1).split("x")] if dilate
                   else [1] * len(sizes))
        taps = math.prod(-(-s // d) for s, d in zip(sizes, dilates, strict=True))
        return 2.0 * out * rhs[i] * taps
    if opcode == "dot" and operands:
        lhs = _dims(types.get(operands[0]))
        contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
        if lhs and contract:
            return 2.0 * out * math.prod(lhs[int(i)] for i in contract.group(1).split(",") if i)
    return 0.0


def matmul_operand_types(comps: dict, types: dict, opcode: str, rest: str) -> set:
    """{(lhs element type, rhs element type)} of the convolutions and dots an instruction is
    or calls (fusions, nested ones included), e.g. {("s8", "s8")} for an int8 matmul."""
    out: set = set()
    seen: set = set()

    def visit(types: dict, opcode: str, rest: str) -> None:
        if opcode in ("convolution", "dot"):
            ops = re.findall(r"%([\w.\-]+)", _operand_list(rest))[:2]
            out.add(tuple((types.get(o) or "").split("[")[0] for o in ops))
        for callee in re.findall(r"calls=%?([\w.\-]+)", rest):
            if callee in comps and callee not in seen:
                seen.add(callee)
                inner = {name: result for name, result, _, _ in comps[callee]}
                for _, _, op, r in comps[callee]:
                    visit(inner, op, r)

    visit(types, opcode, rest)
    return out


def matmul_flops(comps: dict, comp: str, seen=None) -> float:
    """FLOPs of the convolutions and dots in a fused computation, nested fusions included."""
    seen = seen if seen is not None else set()
    if comp in seen or comp not in comps:
        return 0.0
    seen.add(comp)
    types = {name: result for name, result, _, _ in comps[comp]}
    flops = 0.0
    for _, result, opcode, rest in comps[comp]:
        flops += instruction_flops(types, result, opcode, rest)
        for callee in re.findall(r"calls=%?([\w.\-]+)", rest):
            flops += matmul_flops(comps, callee, seen)
    return flops
