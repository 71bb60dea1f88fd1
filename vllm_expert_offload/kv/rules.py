"""Which KV-cache block size each group can use: the decision alone, free of vLLM objects.

The startup fix (integration/kv/fix.py), the `check-kv` tool and the unit tests all call these functions, so the
rule that runs at startup is the rule the tests exercise. The rule mirrors what vLLM's worker does with a block
size (`select_common_block_size`, `AttentionGroup.create_metadata_builders`, kernel-block mapping of packed
caches) and adds the check vLLM lacks: a compressed cache must hold whole compressed states per kernel block,
otherwise DeepSeek-V4's ratio-128 layers get 0-byte pages at `--block-size 64` and the engine divides by zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from ..errors import ExpertOffloadError

# Candidate sizes beyond the requested one and the backends' own: powers of two up to this many tokens.
LARGEST_CANDIDATE = 4096


class KVBlockLayoutError(ExpertOffloadError, ValueError):
    """No block size lets a KV-cache group's backends read whole pages; raised at startup, naming the group,
    its backends and the sizes that would work, instead of a ZeroDivisionError or a kernel fault later."""


@dataclass(frozen=True)
class BackendSizes:
    """The kernel block sizes one attention backend declares (`get_supported_kernel_block_sizes`):
    exact sizes, and the bases of its `MultipleOf` entries."""

    name: str
    exact: tuple[int, ...] = ()
    multiple_of: tuple[int, ...] = ()

    def accepts(self, size: int) -> bool:
        """vLLM's `_block_size_is_supported` for one backend: an exact size must match, a base must divide."""
        return size in self.exact or any(size % base == 0 for base in self.multiple_of)

    def describe(self) -> str:
        return "[" + ", ".join([*map(str, self.exact), *(f"MultipleOf({b})" for b in self.multiple_of)]) + "]"


@dataclass(frozen=True)
class Member:
    """One attention backend in a group, with the compression of the cache it reads: `tokens_per_state` is
    the spec's (1 for plain attention, the compress ratio for DeepSeek-V4's compressed caches).
    `state_bytes` (all heads of one stored state) and `page_alignment` (the spec's page padding unit) say
    whether a page of fewer tokens needs padding; 0 and 1 when unknown or irrelevant."""

    backend: BackendSizes
    tokens_per_state: int | Fraction = 1
    state_bytes: int = 0
    page_alignment: int = 1

    @property
    def compressed(self) -> bool:
        return self.tokens_per_state > 1

    def splits_into(self, kernel: int) -> bool:
        """Whether a packed block of this cache can be read as `kernel`-token kernel blocks. vLLM views a
        split block as consecutive pages of `kernel // ratio` states (`map_kv_cache_to_kernel_blocks`, 0.32 and
        0.33): only compressed caches are written through their block tables, and a page that needs padding
        would put every kernel block after the first off its alignment (vLLM then refuses the view)."""
        if not self.compressed:
            return False
        return int(kernel // self.tokens_per_state) * self.state_bytes % self.page_alignment == 0

    def describe(self) -> str:
        ratio = f", compression ratio {self.tokens_per_state}" if self.compressed else ""
        return f"{self.backend.name} takes {self.backend.describe()}{ratio}"


@dataclass(frozen=True)
class GroupFacts:
    """A KV-cache group as the block-size decision sees it.

    `requested` is the block size vLLM asked for: `--block-size` for the layers that follow it, a
    model-fixed size for the others (DeepSeek-V4's sliding window 64, compressor states 4 and 8).
    `packed` is true when other layers' pages sit between this group's blocks (block-outermost layouts):
    vLLM then splits a block into kernel blocks per backend, and only compressed caches whose smaller pages
    need no padding can be split. `gpu` names the GPU family the backends' sizes are for ("SM120"), if any.
    """

    name: str
    members: tuple[Member, ...]
    requested: int
    packed: bool = False
    gpu: str = ""


def _kernel_for(backends: Sequence[BackendSizes], size: int) -> int | None:
    """`select_common_block_size`: `size` itself when every backend accepts it, else the largest exact size
    dividing it that every backend accepts, else None (vLLM raises "No common block size")."""
    if all(b.accepts(size) for b in backends):
        return size
    divisors = sorted({s for b in backends for s in b.exact if size % s == 0}, reverse=True)
    return next((s for s in divisors if all(b.accepts(s) for b in backends)), None)


def _holds_whole_states(kernel: int, tokens_per_state: int | Fraction) -> bool:
    """A compressed cache needs kernel blocks that are whole multiples of its ratio: a smaller block holds
    zero states (an empty page), a non-multiple leaves tokens no page stores."""
    return tokens_per_state <= 0 or kernel % tokens_per_state == 0


def kernel_block_sizes(group: GroupFacts, size: int) -> tuple[int, ...] | None:
    """The kernel block size each member would use with `size`-token blocks, or None if one has none."""
    if group.packed:
        kernels = [_kernel_for([m.backend], size) for m in group.members]
    else:
        common = _kernel_for([m.backend for m in group.members], size)
        kernels = [common] * len(group.members)
    usable: list[int] = []
    for kernel, member in zip(kernels, group.members):
        if kernel is None or not _holds_whole_states(kernel, member.tokens_per_state):
            return None
        if group.packed and kernel != size and not member.splits_into(kernel):
            return None
        usable.append(kernel)
    return tuple(usable)


def _candidates(group: GroupFacts) -> set[int]:
    """Sizes worth trying: powers of two, the backends' exact sizes, and the smallest multiple of the
    requested size that each `MultipleOf` base and every integer ratio divide."""
    sizes = {2**i for i in range(LARGEST_CANDIDATE.bit_length())} | {group.requested}
    ratios = [m.tokens_per_state for m in group.members if isinstance(m.tokens_per_state, int) and m.compressed]
    for member in group.members:
        sizes.update(member.backend.exact)
        sizes.update(math.lcm(group.requested, base, *ratios) for base in member.backend.multiple_of)
    return sizes


def workable_sizes(group: GroupFacts) -> list[int]:
    """Candidate block sizes every member of the group can use, ascending."""
    return sorted(s for s in _candidates(group) if kernel_block_sizes(group, s) is not None)


def refusal(group: GroupFacts, workable: Sequence[int]) -> str:
    """The startup error for one group: what was asked, each backend's sizes, and what would work."""
    members = "; ".join(m.describe() for m in group.members)
    works = ", ".join(map(str, workable)) if workable else "none (no size fits every backend and ratio)"
    packed = ", blocks packed block-outermost" if group.packed else ""
    gpu = f" on {group.gpu}" if group.gpu else ""
    return (
        f"KV-cache group {group.name}{gpu}: block size {group.requested} is not usable ({members}{packed}); "
        f"sizes that would work: {works}"
    )


def _raise_if_any(failures: Iterable[str]) -> None:
    messages = list(failures)
    if messages:
        raise KVBlockLayoutError("\n".join(messages))


def resolve_block_sizes(groups: Sequence[GroupFacts]) -> dict[str, int]:
    """Choose each group's block size: the requested one wherever its backends can use it (it sets the
    prefix-cache granularity), else the smallest workable multiple of it, else the smallest workable size.
    Raises KVBlockLayoutError listing every group with no workable size."""
    chosen: dict[str, int] = {}
    failures = []
    for group in groups:
        if kernel_block_sizes(group, group.requested) is not None:
            chosen[group.name] = group.requested
            continue
        workable = workable_sizes(group)
        if not workable:
            failures.append(refusal(group, workable))
            continue
        multiples = [s for s in workable if s % group.requested == 0]
        chosen[group.name] = (multiples or workable)[0]
    _raise_if_any(failures)
    return chosen


def check_block_sizes(groups: Sequence[GroupFacts]) -> None:
    """Refuse groups whose planned block size (no longer changeable: the KV cache is laid out) is unusable,
    naming the sizes that would have worked."""
    _raise_if_any(
        refusal(group, workable_sizes(group))
        for group in groups
        if kernel_block_sizes(group, group.requested) is None
    )
