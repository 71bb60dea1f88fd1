"""What a compiled Triton kernel's PTX and SASS say about its decode: which global loads read trellis memory and
how wide they are, and how many instructions one iteration of the decode loop costs.

Trellis loads are found by address provenance, not by width or position: the value of the kernel argument the
trellis addresses come from (`StaticKernel.trellis_arg`) is followed through every instruction (flow-insensitively,
to a fixpoint; PTX registers are mostly single-assignment), each load through a followed address starts a new level
(the table entry it reads), and the loads whose address derives from the level `trellis_indirection` reads are the
trellis loads. Activations, row ids and tables never derive from that argument, so they are never counted.

The decode loop is the innermost LLVM loop (its `Loop Header: Depth=N` comment, up to the last branch back to it)
holding a trellis load; in SASS (nvdisasm with line info), the innermost loop holding code of `triton_decode.py`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_INSTRUCTION = re.compile(r"^(?:@!?%\w+\s+)?([a-z][\w.]*)\s*(.*)$")
_REGISTER = re.compile(r"%[a-z]+\d+")
_VECTOR = re.compile(r"\.v(\d)")
_WIDTH = re.compile(r"\.[busf](8|16|32|64|128)\b")
_LOOP_HEADER = re.compile(r"^(\$L__\w+):.*Loop Header: Depth=(\d+)")
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")
_SASS_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/")


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
        raise ValueError(f"no access width in {ins.opcode!r}")
    vector = _VECTOR.search(ins.opcode)
    return int(width.group(1)) * (int(vector.group(1)) if vector else 1)


def trellis_loads(ptx: str, param_index: int, indirection: int) -> list[Instruction]:
    """The global loads whose address derives from kernel parameter `param_index` through `indirection` loads."""
    lines = ptx.splitlines()
    instructions = _parse(lines)
    param = re.compile(rf"_param_{param_index}\b")
    levels: list[set[str]] = [set() for _ in range(indirection + 1)]
    changed = True
    while changed:
        changed = False
        for ins in instructions:
            if ins.opcode.startswith("ld.param") and param.search(ins.address):
                targets = [(0, ins.defs)]
            elif _is_global_load(ins):
                addr = set(_REGISTER.findall(ins.address))
                targets = [(lv + 1, ins.defs) for lv in range(indirection) if addr & levels[lv]]
            else:
                targets = [(lv, ins.defs) for lv in range(indirection + 1) if set(ins.uses) & levels[lv]]
            for lv, defs in targets:
                if not set(defs) <= levels[lv]:
                    levels[lv].update(defs)
                    changed = True
    return [ins for ins in instructions
            if _is_global_load(ins) and set(_REGISTER.findall(ins.address)) & levels[indirection]]


@dataclass(frozen=True)
class Loop:
    start: int  # line of the header label
    end: int  # line of the last branch back to it
    depth: int


def ptx_loops(ptx: str) -> list[Loop]:
    lines = ptx.splitlines()
    loops = []
    for i, text in enumerate(lines):
        m = _LOOP_HEADER.match(text.strip())
        if m:
            back = [j for j in range(i, len(lines)) if re.search(rf"\bbra(\.uni)?\s+{re.escape(m.group(1))};", lines[j])]
            if back:
                loops.append(Loop(i, back[-1], int(m.group(2))))
    return loops


def count_ptx_instructions(ptx_lines: list[str], loop: Loop) -> int:
    """Instructions between a loop's header and its back branch (inline-asm bodies included, directives not)."""
    return len(_statements(ptx_lines[loop.start : loop.end + 1]))


def decode_loop_ptx_instructions(ptx: str, loads: list[Instruction]) -> int:
    """Instructions of the innermost loop holding a trellis load (the widest count if several loops decode)."""
    lines = ptx.splitlines()
    holding = [lp for lp in ptx_loops(ptx) if any(lp.start <= ld.line <= lp.end for ld in loads)]
    if not holding:
        raise ValueError("no loop of the kernel holds a trellis load: is the decode outside the K loop?")
    innermost = [lp for lp in holding if not any(o is not lp and lp.start <= o.start and o.end <= lp.end for o in holding)]
    return max(count_ptx_instructions(lines, lp) for lp in innermost)


def decode_loop_sass_instructions(sass: str, marker: str) -> int | None:
    """SASS instructions of the innermost loop whose line info names `marker` (the decode's source file), from
    `nvdisasm -c -gi`; None when no loop does."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, t in enumerate(lines) if (m := _SASS_LABEL.match(t.strip()))}
    loops = []
    for j, text in enumerate(lines):
        m = _SASS_BRANCH.search(text)
        if m and labels.get(m.group(1), j + 1) < j:
            start = labels[m.group(1)]
            if any(marker in t for t in lines[start:j]):
                loops.append((start, j))
    inner = [(s, e) for s, e in loops if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in loops)]
    counts = [sum(1 for t in lines[s : e + 1] if _SASS_INSTRUCTION.search(t)) for s, e in inner]
    return max(counts) if counts else None
