"""What a compiled Triton kernel's PTX and SASS say about its decode: which global loads read trellis memory and
how wide they are, and how many instructions one iteration of the decode loop costs.

Trellis loads are found by address provenance, not by width or position: the value of the kernel argument the
trellis addresses come from (`StaticKernel.trellis_arg`) is followed through every instruction (flow-insensitively,
to a fixpoint; PTX registers are mostly single-assignment), each load through a followed address starts a new level
(the table entry it reads), and the loads whose address derives from the level `trellis_indirection` reads are the
trellis loads. Activations, row ids and tables never derive from that argument, so they are never counted.

The decode loop is the innermost LLVM loop holding a trellis load (the basic blocks LLVM's comments assign to it); in SASS (nvdisasm), the innermost loop (label to backward branch) holding a global load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_INSTRUCTION = re.compile(r"^(?:@!?%\w+\s+)?([a-z][\w.]*)\s*(.*)$")
_REGISTER = re.compile(r"%[a-z]+\d+")
_VECTOR = re.compile(r"\.v(\d)")
_WIDTH = re.compile(r"\.[busf](8|16|32|64|128)\b")
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")
_SASS_GLOBAL_LOAD = re.compile(r"\bLDG(STS)?\.")
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


_BLOCK_START = re.compile(r"^(?:\$L__(BB\d+_\d+):|// %bb\.\d+:)(.*)$")
_IN_LOOP = re.compile(r"in Loop: Header=(BB\d+_\d+)")


def ptx_loops(ptx: str) -> dict[str, list[int]]:
    """Each LLVM loop (by its header block's name) -> the lines of the basic blocks whose innermost loop it is.
    LLVM annotates every block of a loop (`in Loop: Header=BB0_4 Depth=1`) and its header (`Loop Header`); the
    blocks need not be contiguous (branches inside the body place some before the header)."""
    loops: dict[str, list[int]] = {}
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
            elif inner:
                current = inner.group(1)
            else:
                current = None
        if current is not None:
            loops.setdefault(current, []).append(i)
    return loops


def decode_loop_ptx_instructions(ptx: str, loads: list[Instruction]) -> int:
    """Instructions of the innermost loop holding a trellis load (the largest count if several loops decode),
    inline-asm bodies counted statement by statement, directives not."""
    lines = ptx.splitlines()
    load_lines = {ld.line for ld in loads}
    counts = [len(_statements([lines[i] for i in members])) for members in ptx_loops(ptx).values()
              if load_lines & set(members)]
    if not counts:
        raise ValueError("no loop of the kernel holds a trellis load: is the decode outside the K loop?")
    return max(counts)


def decode_loop_sass_instructions(sass: str) -> int | None:
    """SASS instructions of the innermost loop holding a global load (LDG, or LDGSTS where loads are pipelined),
    from `nvdisasm -c` (the widest count if several loops do); None when no loop does."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, t in enumerate(lines) if (m := _SASS_LABEL.match(t.strip()))}
    loops = []
    for j, text in enumerate(lines):
        m = _SASS_BRANCH.search(text)
        if m and labels.get(m.group(1), j + 1) < j:
            start = labels[m.group(1)]
            if any(_SASS_GLOBAL_LOAD.search(t) for t in lines[start:j]):
                loops.append((start, j))
    inner = [(s, e) for s, e in loops if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in loops)]
    counts = [sum(1 for t in lines[s : e + 1] if _SASS_INSTRUCTION.search(t)) for s, e in inner]
    return max(counts) if counts else None
