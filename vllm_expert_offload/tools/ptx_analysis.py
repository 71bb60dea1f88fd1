"""What a compiled Triton kernel's PTX and SASS say about its decode: which global loads read trellis memory and
how wide they are, and how many instructions one iteration of the decode loop costs.

Trellis loads are found by address provenance, not by width or position: the value of the kernel argument the
trellis addresses come from (`StaticKernel.trellis_arg`) is followed through every instruction (flow-insensitively,
to a fixpoint; PTX registers are mostly single-assignment), each load through a followed address starts a new level
(the table entry it reads), and the loads whose address derives from the level `trellis_indirection` reads are the
trellis loads. Activations, row ids and tables never derive from that argument, so they are never counted.

One refinement: a table may hold more than trellis addresses. The dense kernel's piece table holds, beside the
trellis address, offsets into the suh/svh arrays (`suh_ptr + suh_at + k`), so those fp16 loads derive from the
table too. A load whose address also derives, by arithmetic alone (no load in between), from another pointer
parameter of the kernel (PTX marks them `.ptr`) is an access to that parameter's array at an offset the table
holds, not a trellis load, and starts no level. A trellis address is a value the table (or the argument itself)
holds plus offsets; it never adds a second array's base. Indices read through another pointer (the MoE kernels'
expert ids, `trellis_table + ids[slot]`) pass through a load, so they exclude nothing.

The decode loop, in PTX, is the innermost LLVM loop holding a trellis load (the basic blocks LLVM's comments assign
to it), counted with the loops nested in it: one K-step of the decode issues those too (moe_down sums its gate/up
partials over `gate_parts` inside each K-step), so they belong to "the instructions in the inner loop per decoded
weight". A nested loop's body counts once (its trip count is a runtime value), so where it runs more than once the
count is a lower bound. In SASS (`nvdisasm -c -g`), it is the innermost loop (label to backward branch, so the
loops laid out inside that range count as well) holding a global load that ptxas's line info (Triton compiles with -lineinfo)
places at the source line of a PTX trellis load: not just any loop with a global load, which in moe_down would be
the partial-sum loop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ToolInputError

_INSTRUCTION = re.compile(r"^(?:@!?%\w+\s+)?([a-z][\w.]*)\s*(.*)$")
_REGISTER = re.compile(r"%[a-z]+\d+")
_VECTOR = re.compile(r"\.v(\d)")
_WIDTH = re.compile(r"\.[busf](8|16|32|64|128)\b")
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")
_SASS_GLOBAL_LOAD = re.compile(r"\bLDG(STS)?\.")
_SASS_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/")
_PARAM_INDEX = re.compile(r"_param_(\d+)\b")
_POINTER_PARAM = re.compile(r"^\s*\.param\s+\.u64\s+\.ptr\b[^\n]*?_param_(\d+)\b", re.M)


@dataclass(frozen=True)
class Instruction:
    line: int  # index into the PTX's lines
    opcode: str
    defs: tuple[str, ...]  # registers written
    uses: tuple[str, ...]  # registers read (for a load: the address's)
    address: str  # the text inside [...], if any (cp.async: the global source's)
    operands: str


def _statements(ptx_lines: list[str], start: int = 0) -> list[tuple[int, str]]:
    """(line index, statement) of every instruction: inline asm may put several on one line, inside braces;
    directives (.loc, .reg), labels and comments are not instructions."""
    out = []
    for i, text in enumerate(ptx_lines, start):
        for part in text.split("//", 1)[0].split(";")[:-1]:
            statement = part.strip().strip("{}").strip()
            if statement and not statement.startswith((".", "$")):
                out.append((i, statement))
    return out


def _parse(ptx_lines: list[str]) -> list[Instruction]:
    out = []
    for i, statement in _statements(ptx_lines):
        m = _INSTRUCTION.match(statement)
        if not m:
            continue
        opcode, operands = m.groups()
        brackets = re.findall(r"\[([^\]]*)\]", operands)
        address = brackets[-1] if opcode.startswith("cp.async") and brackets else (brackets[0] if brackets else "")
        if opcode.startswith(("st.", "bra", "bar", "ret", "red.", "prefetch", "fence", "membar", "cp.async", "exit")):
            defs, uses = (), tuple(_REGISTER.findall(operands))
        else:
            head, _, rest = operands.partition(",")
            if head.strip().startswith("{"):  # vector destination: { %r1, %r2 }
                head, _, rest = operands.partition("}")
            defs, uses = tuple(_REGISTER.findall(head)), tuple(_REGISTER.findall(rest))
        out.append(Instruction(i, opcode, defs, uses, address, operands))
    return out


def _is_global_load(ins: Instruction) -> bool:
    """ld from global (generic addresses included) or cp.async from global into shared memory (pipelined loads)."""
    if ins.opcode.startswith("cp.async") and ".global" in ins.opcode:
        return True
    return ins.opcode.startswith("ld.") and not any(s in ins.opcode for s in (".param", ".shared", ".local", ".const"))


def load_bits(ins: Instruction) -> int:
    """Bits one lane reads with a load, e.g. ld.global.v4.b32 -> 128, ld.global.nc.b16 -> 16, cp.async of 4 bytes
    -> 32."""
    if ins.opcode.startswith("cp.async"):
        size = ins.operands.split(",")[2].strip()
        return 8 * int(size, 0)
    width = _WIDTH.search(ins.opcode)
    if width is None:
        raise ToolInputError(f"no access width in {ins.opcode!r}")
    vector = _VECTOR.search(ins.opcode)
    return int(width.group(1)) * (int(vector.group(1)) if vector else 1)


def pointer_params(ptx: str) -> set[int]:
    """Indices of the kernel's pointer parameters (`.param .u64 .ptr ... NAME_param_N`)."""
    return {int(n) for n in _POINTER_PARAM.findall(ptx)}


def _param_of(ins: Instruction) -> int | None:
    """The parameter index an `ld.param` reads, e.g. 3 for [k_param_3]."""
    m = _PARAM_INDEX.search(ins.address)
    return int(m.group(1)) if m else None


def _derived(instructions: list[Instruction], seeds: set[str]) -> set[str]:
    """Registers computed from `seeds` by arithmetic alone (every instruction but a load; predicates excluded: a
    comparison of an address is not an address)."""
    derived = set(seeds)
    changed = True
    while changed:
        changed = False
        for ins in instructions:
            if ins.opcode.startswith(("ld.", "cp.async")) or not set(ins.uses) & derived:
                continue
            new = {d for d in ins.defs if not d.startswith("%p")} - derived
            if new:
                derived |= new
                changed = True
    return derived


def trellis_loads(ptx: str, param_index: int, indirection: int) -> list[Instruction]:
    """The global loads whose address derives from kernel parameter `param_index` through `indirection` loads and
    not, by arithmetic alone, from another pointer parameter (the module docstring says why)."""
    lines = ptx.splitlines()
    instructions = _parse(lines)
    others = pointer_params(ptx) - {param_index}
    foreign = _derived(instructions, {d for ins in instructions if ins.opcode.startswith("ld.param")
                                      and _param_of(ins) in others for d in ins.defs})
    levels: list[set[str]] = [set() for _ in range(indirection + 1)]
    changed = True
    while changed:
        changed = False
        for ins in instructions:
            if ins.opcode.startswith("ld.param") and _param_of(ins) == param_index:
                targets = [(0, ins.defs)]
            elif _is_global_load(ins):
                addr = set(_REGISTER.findall(ins.address))
                targets = [] if addr & foreign else [(lv + 1, ins.defs) for lv in range(indirection)
                                                      if addr & levels[lv]]
            else:
                targets = [(lv, ins.defs) for lv in range(indirection + 1) if set(ins.uses) & levels[lv]]
            for lv, defs in targets:
                if not set(defs) <= levels[lv]:
                    levels[lv].update(defs)
                    changed = True
    return [ins for ins in instructions if _is_global_load(ins)
            and (addr := set(_REGISTER.findall(ins.address))) & levels[indirection] and not addr & foreign]


_BLOCK_START = re.compile(r"^(?:\$L__(BB\d+_\d+):|// %bb\.\d+:)(.*)$")
_IN_LOOP = re.compile(r"in Loop: Header=(BB\d+_\d+)")
_PARENT_LOOP = re.compile(r"Parent Loop (BB\d+_\d+) Depth=(\d+)")
_PTX_FILE = re.compile(r"^\s*\.file\s+(\d+)\s+\"([^\"]+)\"(?:\s*,?\s*\"([^\"]+)\")?", re.M)  # path, or dir + name
_PTX_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\b")
_SASS_LINE_INFO = re.compile(r"//## File \"([^\"]+)\", line (\d+)")


@dataclass(frozen=True)
class PtxLoop:
    lines: tuple[int, ...]  # lines of the basic blocks whose innermost loop this is
    parent: str | None  # header of the loop it is nested in


def ptx_loops(ptx: str) -> dict[str, PtxLoop]:
    """Each LLVM loop (by its header block's name) -> the lines of the basic blocks whose innermost loop it is, and
    the loop it is nested in. LLVM annotates every block of a loop (`in Loop: Header=BB0_4 Depth=1`) and its header
    (`Loop Header`, under `Parent Loop BB0_2 Depth=1` lines when nested); the blocks need not be contiguous
    (branches inside the body place some before the header)."""
    members: dict[str, list[int]] = {}
    parents: dict[str, str | None] = {}
    lines = ptx.splitlines()
    current = None
    for i, text in enumerate(lines):
        m = _BLOCK_START.match(text.strip())
        if m:
            label, comment = m.groups()
            for follow in lines[i + 1 :]:  # LLVM may continue the block's comment on comment-only lines
                if not follow.strip().startswith("//"):
                    break
                comment += follow
            inner = _IN_LOOP.search(comment)
            if "Loop Header" in comment and label:
                current = label
                enclosing = sorted(_PARENT_LOOP.findall(comment), key=lambda found: int(found[1]))
                parents[label] = enclosing[-1][0] if enclosing else None
            elif inner:
                current = inner.group(1)
            else:
                current = None
        if current is not None:
            members.setdefault(current, []).append(i)
    return {header: PtxLoop(tuple(found), parents.get(header)) for header, found in members.items()}


def _with_nested(loops: dict[str, PtxLoop], header: str) -> list[int]:
    """Lines of loop `header` and of every loop nested in it, at any depth."""
    out = list(loops[header].lines)
    for child, loop in loops.items():
        if loop.parent == header:
            out += _with_nested(loops, child)
    return out


def decode_loop_ptx_instructions(ptx: str, loads: list[Instruction]) -> int:
    """Instructions of the innermost loop holding a trellis load, with the loops nested in it (the largest count
    if several loops decode), inline-asm bodies counted statement by statement, directives not."""
    lines = ptx.splitlines()
    load_lines = {ld.line for ld in loads}
    loops = ptx_loops(ptx)
    counts = [len(_statements([lines[i] for i in sorted(_with_nested(loops, header))]))
              for header, loop in loops.items() if load_lines & set(loop.lines)]
    if not counts:
        raise ToolInputError("no loop of the kernel holds a trellis load: is the decode outside the K loop?")
    return max(counts)


def source_lines(ptx: str, loads: list[Instruction]) -> set[tuple[str, int]]:
    """(source file, line) of each load: the `.loc` in force at it (the innermost location where it is inlined)."""
    lines = ptx.splitlines()
    files = {int(n): f"{path}/{name}" if name else path for n, path, name in _PTX_FILE.findall(ptx)}
    at, where = {}, None
    for i, text in enumerate(lines):
        m = _PTX_LOC.match(text)
        if m:
            where = (files[int(m.group(1))], int(m.group(2)))
        at[i] = where
    return {at[ld.line] for ld in loads if at[ld.line] is not None}


def decode_loop_sass_instructions(sass: str, trellis_lines: set[tuple[str, int]]) -> int | None:
    """SASS instructions of the innermost loop holding a trellis load: a global load (LDG, or LDGSTS where loads
    are pipelined) at one of `trellis_lines` (`source_lines` of the PTX trellis loads), by the line info of
    `nvdisasm -c -g`; the loops nested in it count too (the widest count if several loops decode). None when no
    loop holds one (e.g. ptxas unrolled it)."""
    lines = sass.splitlines()
    if not any(_SASS_LINE_INFO.search(t) for t in lines):
        raise ToolInputError(
            "the SASS has no line info: disassemble with nvdisasm -g a cubin ptxas made with -lineinfo "
            "(unset TRITON_DISABLE_LINE_INFO)"
        )
    labels = {m.group(1): i for i, t in enumerate(lines) if (m := _SASS_LABEL.match(t.strip()))}
    trellis_at, where = [], None
    for i, text in enumerate(lines):
        m = _SASS_LINE_INFO.search(text)
        if m:
            where = (m.group(1), int(m.group(2)))
        elif where in trellis_lines and _SASS_GLOBAL_LOAD.search(text):
            trellis_at.append(i)
    loops = []
    for j, text in enumerate(lines):
        m = _SASS_BRANCH.search(text)
        if m and labels.get(m.group(1), j + 1) < j:
            start = labels[m.group(1)]
            if any(start < i < j for i in trellis_at):
                loops.append((start, j))
    inner = [(s, e) for s, e in loops if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in loops)]
    counts = [sum(1 for t in lines[s : e + 1] if _SASS_INSTRUCTION.search(t)) for s, e in inner]
    return max(counts) if counts else None
