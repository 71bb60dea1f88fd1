"""The exllamav3 backend: exllamav3 1.6.5's compiled CUDA kernels over our pointer tables.

- routed experts, up to 8 tokens: `exl3_moe_coop` (two fused launches per layer, one slot per (token, expert));
- routed experts, more tokens: `exl3_moe` over routing sorted by expert, into a per-slot fp32 scratch summed by
  `exl3_moe_gather` in a fixed order (deterministic), in chunks of at most `MOE_ROWS` tokens so that no expert can
  hold more rows than its temp buffers (each token picks an expert once): no count is read back, nothing syncs;
- dense linears: `exl3_gemm`, the rotations with suh/svh done by the kernel.
The tables are the same int64 address tables every backend reads (VRAM and the host arena's device alias alike);
exllamav3 dereferences them on the device (exl3-format.md §4).

Every call goes through `call_ext`, which passes keyword arguments in the order of `SIGNATURES`, the argument lists
of exllamav3 1.6.5's C++ headers; tests/kernels/test_exllamav3_signatures.py checks that table against the headers, so a
signature change between releases fails a test, not a server.

All EXL3 kernels of a device share exllamav3's device-wide barrier (`locks`, exl3_devctx.cu), and concurrent use
has hung other integrations on sm_90+: every launch of a device runs on one stream of this module's (joined to
the caller's stream both ways, which CUDA-graph capture records as a fork and a join). `exl3_gemm` autotunes per
shape on first use with stream synchronisation, and the first MoE launch allocates the barrier buffer; neither
may happen inside graph capture, so each kernel warms up during vLLM's profile run (which precedes capture) over
the batch sizes vLLM will capture.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from ..errors import InvalidValueError
from ..exl3.bitrate import HALF_K, INTEGER_K
from ..exl3.codebook import Codebook
from ..exl3.naming import PROJECTIONS
from ..exl3.tensors import Exl3Linear
from ..memory.arena import HostArena
from ..offload.phase import PHASE
from ..offload.tiers import PlacedExpert
from .contract import Backend, ExpertCrop
from .linear import LinearShard
from .matrix_table import MatrixTable
from .pointer_tables import PARTS, PointerTables
from .rotated import RotatedLinear

VERSION = "1.6.5"  # the exllamav3 release SIGNATURES was read from
TENSOR, OPTIONAL_TENSOR, INT, FLOAT, BOOL = "tensor", "optional tensor", "int", "float", "bool"

# Argument names and kinds of each extension function we call, in the order of exllamav3 1.6.5's declarations:
# exl3_moe_coop (quant/exl3_moe_coop.cuh), exl3_moe, exl3_moe_gather, exl3_moe_max_concurrency (quant/exl3_moe.cuh),
# exl3_gemm (quant/exl3_gemm.cuh).
_TABLES = tuple((f"{side}_{part}", TENSOR) for side in ("g", "u", "d") for part in PARTS)
SIGNATURES: dict[str, tuple[tuple[str, str], ...]] = {
    "exl3_moe_coop": (
        ("x", TENSOR), ("sel", TENSOR), ("rw", TENSOR), ("min_expert", INT), ("max_expert", INT), ("Hi", INT),
        *_TABLES,
        ("g_bias", OPTIONAL_TENSOR), ("u_bias", OPTIONAL_TENSOR), ("d_bias", OPTIONAL_TENSOR),
        ("Kg", FLOAT), ("Ku", FLOAT), ("Kd", FLOAT), ("mcg", BOOL), ("mul1", BOOL),
        ("act", INT), ("act_limit", FLOAT), ("gated", BOOL),
        ("had_g", TENSOR), ("had_u", TENSOR), ("gu_g", TENSOR), ("gu_u", TENSOR), ("act_out", TENSOR),
        ("d_out", TENSOR), ("ctr", TENSOR), ("out", TENSOR), ("sh_out", OPTIONAL_TENSOR),
        ("sh_gate_w", OPTIONAL_TENSOR),
    ),
    "exl3_moe": (
        ("hidden_state", TENSOR), ("output_state", TENSOR), ("expert_count", TENSOR), ("token_sorted", TENSOR),
        ("weight_sorted", TENSOR), ("temp_state_g", TENSOR), ("temp_state_u", TENSOR),
        ("temp_intermediate_g", TENSOR), ("temp_intermediate_u", TENSOR), ("act_function", INT),
        ("K_gate", FLOAT), ("K_up", FLOAT), ("K_down", FLOAT),
        *((f"{p}_ptrs_{part}", TENSOR) for p in PROJECTIONS for part in PARTS),
        *((f"{p}_{flag}", BOOL) for p in PROJECTIONS for flag in ("mcg", "mul1")),
        ("act_limit", FLOAT), ("num_active", INT), ("output_scratch", OPTIONAL_TENSOR),
        ("fused_base", OPTIONAL_TENSOR), ("count_lo", INT), ("count_hi", INT), ("m_tile", INT),
    ),
    "exl3_moe_gather": (
        ("output_state", TENSOR), ("output_scratch", TENSOR), ("flat_expert", TENSOR), ("inv_order", TENSOR),
        ("expert_start", TENSOR), ("slot_base", TENSOR), ("slot_kind", TENSOR), ("weight_sorted", TENSOR),
    ),
    "exl3_moe_max_concurrency": (("device", INT),),
    "exl3_gemm": (
        ("A", TENSOR), ("B", TENSOR), ("C", TENSOR), ("suh", OPTIONAL_TENSOR), ("A_had", OPTIONAL_TENSOR),
        ("svh", OPTIONAL_TENSOR), ("force_shape_idx", INT), ("mcg", BOOL), ("mul1", BOOL), ("force_num_sms", INT),
    ),
}

COOP_MAX_TOKENS = 8  # MAX_BSZN of exl3_moe_coop
COOP_MAX_SLOTS = 256  # its scratch holds at most this many (token, expert) slots
MOE_ROWS = 128  # row capacity per expert of exl3_moe's temp buffers (exllamav3's CUDA default MOE_FUSED_ROWS)
ACT_SILU = 0  # MOE_COOP_ACT_SILU = MOE_ACT_SILU
FUSED_SLOTS = 1  # exl3_moe_gather's slot_kind: the slots hold router-weighted outputs of exl3_moe


def _kind_ok(kind: str, value: object) -> bool:
    if kind == TENSOR:
        return isinstance(value, torch.Tensor)
    if kind == OPTIONAL_TENSOR:
        return value is None or isinstance(value, torch.Tensor)
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # FLOAT


def call_ext(ext: ModuleType, name: str, **arguments: object) -> object:
    """`ext.<name>` called with `arguments` placed in the order of SIGNATURES[name]; a missing or unknown
    argument, or a value of the wrong kind, raises before anything is launched."""
    signature = SIGNATURES[name]
    expected = [arg for arg, _ in signature]
    if set(arguments) != set(expected):
        missing, unknown = sorted(set(expected) - set(arguments)), sorted(set(arguments) - set(expected))
        raise TypeError(f"{name}: missing arguments {missing}, unknown arguments {unknown}")
    wrong = [f"{arg} ({kind})" for arg, kind in signature if not _kind_ok(kind, arguments[arg])]
    if wrong:
        raise TypeError(f"{name}: wrong kind of value for {wrong}")
    return getattr(ext, name)(*(arguments[arg] for arg in expected))


def load_ext() -> ModuleType:
    """exllamav3's prebuilt extension. Only a prebuilt one: `exllamav3.ext` would otherwise JIT-compile ~180 CUDA
    files (minutes) inside a server's startup."""
    return importlib.import_module("exllamav3_ext")


def exllamav3_unavailable(device: torch.device) -> str | None:
    """None when the exllamav3 backend can run on `device`, else why not."""
    if device.type != "cuda":
        return f"its kernels are CUDA kernels, and this layer lives on {device}"
    try:
        load_ext()
    except ImportError as exc:
        return f"exllamav3's compiled extension exllamav3_ext does not import ({exc}); install exllamav3=={VERSION}"
    return None


def rate_refusal(layer: Exl3Linear) -> str | None:
    """None when exllamav3 1.6.5's kernels take this matrix's bits per weight with its codebook, else why not.

    Its rate decoder (bits_k.cuh) takes K in 1..8 and 1.5/2.5/3.5, and exl3_moe_coop.cu, exl3_moe.cu and exl3_gemm.cu
    each refuse a half-integer K unless the codebook is MUL1 (their only half-integer instances are MUL1's). Sets
    read from a checkpoint already obey that (exl3/bitrate.py); sets built any other way are checked here, so a
    layer outside it falls back under `auto` instead of failing inside exllamav3 during vLLM's profiling run."""
    if layer.k not in INTEGER_K and layer.k not in HALF_K:
        return f"{layer.name}: K={layer.k:g} is not a rate its kernels instantiate (1..8, 1.5, 2.5, 3.5)"
    if layer.k in HALF_K and layer.codebook is not Codebook.MUL1:
        return (f"{layer.name}: its kernels take half-integer K={layer.k:g} with the MUL1 codebook only, "
                f"and this set is {layer.codebook.value}")
    return None


def linear_refusal(shards: Sequence[LinearShard]) -> str | None:
    """None when exl3_gemm can compute every shard of this dense linear, else why not (naming the set)."""
    for shard in shards:
        refusal = rate_refusal(shard.layer)
        if refusal is not None:
            return refusal
    return None


def moe_refusal(experts: Sequence[PlacedExpert], crop: ExpertCrop, swiglu_limit: float | None) -> str | None:
    """None when exllamav3's MoE kernels can compute this layer exactly as the reference does, else why not."""
    codebooks = {e.projections[p].codebook for e in experts for p in PROJECTIONS}
    if len(codebooks) != 1:
        return f"its MoE kernels take one codebook across gate, up and down; this layer mixes {sorted(codebooks)}"
    if codebooks == {Codebook.INST3}:
        return "exl3_moe takes the MCG and MUL1 codebooks only; this layer is 3INST"
    refused = next((why for e in experts for p in PROJECTIONS if (why := rate_refusal(e.projections[p]))), None)
    if refused is not None:
        return refused
    ks = {p: sorted({e.projections[p].k for e in experts}) for p in PROJECTIONS}
    mixed = {p: k for p, k in ks.items() if len(k) != 1}
    if mixed:
        return f"its MoE kernels take one K per projection; this layer has {mixed}"
    if ks["gate"] != ks["up"]:
        return f"its MoE kernels take one K for gate and up; this layer has gate K {ks['gate'][0]}, up {ks['up'][0]}"
    shapes = {p: (experts[0].projections[p].in_features, experts[0].projections[p].out_features) for p in PROJECTIONS}
    if shapes["gate"][0] != shapes["down"][1]:
        return f"its MoE kernels take down's output as wide as gate's input; shapes {shapes}"
    if crop.offset != 0 or crop.intermediate != shapes["gate"][1]:
        return (f"this rank's intermediate channels [{crop.offset}, {crop.offset + crop.intermediate}) do not fill "
                f"the 128-aligned cover of {shapes['gate'][1]} that its kernels compute whole (TP crop)")
    if swiglu_limit is not None:
        return "its act_limit clamps SiLU(gate), while swiglu_limit clamps gate before SiLU"
    return None


@functools.cache
def _stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@contextlib.contextmanager
def one_stream(device: torch.device) -> Iterator[None]:
    """Run the body (launches only: tensors are allocated on the caller's stream) on the device's one EXL3 stream,
    ordered after the caller's stream and before its next work, so the caller's allocator never reuses a block
    an EXL3 kernel may still read."""
    if device.type != "cuda":
        yield
        return
    caller, stream = torch.cuda.current_stream(device), _stream(device)
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        yield
    caller.wait_stream(stream)


@dataclass
class _CoopScratch:
    """exl3_moe_coop's buffers for one top-k, fixed in size so the counter layout never moves between calls
    (the kernels leave the counters zeroed for the next call)."""

    had_g: torch.Tensor
    had_u: torch.Tensor
    gu_g: torch.Tensor
    gu_u: torch.Tensor
    act_out: torch.Tensor
    d_out: torch.Tensor
    ctr: torch.Tensor
    out: torch.Tensor

    @classmethod
    def allocate(cls, top_k: int, hidden: int, intermediate: int, device: torch.device) -> _CoopScratch:
        slots = COOP_MAX_TOKENS * top_k
        if slots > COOP_MAX_SLOTS:
            raise InvalidValueError(f"exl3_moe_coop holds {COOP_MAX_SLOTS} slots; top-k {top_k} needs {slots}")
        ctr = (slots * (intermediate // 128) + COOP_MAX_TOKENS * (hidden // 128) + 2 + (slots + 1) + slots)
        half, fp32 = dict(dtype=torch.float16, device=device), dict(dtype=torch.float32, device=device)
        return cls(
            had_g=torch.empty(slots, hidden, **half), had_u=torch.empty(slots, hidden, **half),
            gu_g=torch.empty(slots, intermediate, **fp32), gu_u=torch.empty(slots, intermediate, **fp32),
            act_out=torch.empty(slots, intermediate, **half), d_out=torch.empty(slots, hidden, **fp32),
            ctr=torch.zeros(ctr, dtype=torch.int32, device=device),
            out=torch.zeros(COOP_MAX_TOKENS, hidden, **fp32),
        )


@functools.cache
def _moe_temps(ext: ModuleType, device: torch.device, hidden: int, intermediate: int) -> tuple[torch.Tensor, ...]:
    """exl3_moe's four temp buffers, shared by every layer of a shape on a device: scratch within one launch, and
    all launches of a device run in order on one stream."""
    concurrency = int(call_ext(ext, "exl3_moe_max_concurrency", device=device.index or 0))
    shapes = ((hidden,), (hidden,), (intermediate,), (intermediate,))
    return tuple(torch.empty(concurrency, MOE_ROWS, *s, dtype=torch.float16, device=device) for s in shapes)


class Exllamav3MoE:
    """Routed experts through exllamav3's fused MoE kernels; build only for layers `moe_refusal` passes."""

    def __init__(
        self,
        experts: Sequence[PlacedExpert],
        tables: PointerTables,
        arena: HostArena | None,
        crop: ExpertCrop,
        device: torch.device,
        ext: ModuleType | None = None,
    ) -> None:
        refusal = moe_refusal(experts, crop, None)
        if refusal is not None:
            raise InvalidValueError(f"the exllamav3 backend cannot compute this layer: {refusal}")
        self.ext = ext if ext is not None else load_ext()
        # The tables hold only raw addresses: own what they point to (GPU-tier tensors, scale stacks, the arena).
        self.experts, self.arena, self.pointer_tables = list(experts), arena, tables
        first = experts[0].projections
        codebook = first["gate"].codebook
        self.mcg, self.mul1 = codebook == Codebook.MCG, codebook == Codebook.MUL1
        self.k = {p: float(first[p].k) for p in PROJECTIONS}
        self.num_experts, self.hidden, self.device = len(experts), crop.hidden, device
        self.width, self.intermediate = first["gate"].in_features, first["gate"].out_features
        self.coop: dict[int, _CoopScratch] = {}
        self.warm = False

    def _tables(self, prefix: dict[str, str], part_names: dict[str, str]) -> dict[str, torch.Tensor]:
        return {f"{prefix[p]}_{part_names[part]}": self.pointer_tables.table(p, part)
                for p in PROJECTIONS for part in PARTS}

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, apply_router_weight_on_input: bool
    ) -> torch.Tensor:
        """Router-weighted sum over this rank's routed experts; topk_ids are local ids."""
        tokens, top_k = topk_ids.shape
        if apply_router_weight_on_input:
            if top_k != 1:
                raise InvalidValueError("router weights on the input need top-k 1 (as vLLM requires)")
            x, topk_weights = x * topk_weights.to(x.dtype), torch.ones_like(topk_weights)
        hidden = F.pad(x, (0, self.width - x.shape[1])).to(torch.float16).contiguous()
        weights, ids = topk_weights.to(torch.float16).contiguous(), topk_ids.to(torch.int64).contiguous()
        if tokens <= COOP_MAX_TOKENS:
            out = self._decode(hidden, weights, ids).clone()
        else:
            out = torch.cat([self._prefill(hidden[s : s + MOE_ROWS], weights[s : s + MOE_ROWS], ids[s : s + MOE_ROWS])
                             for s in range(0, tokens, MOE_ROWS)])
        if PHASE.profiling and not self.warm:
            self.warm_up(top_k)
        # Contiguous as exl3_moe's fake promises (kernels/ops.py): a padded width's slice of an fp32 output is a
        # strided view, which `.to(float32)` would hand back as it is.
        return out[:, : self.hidden].to(x.dtype).contiguous()

    def _launch(self, name: str, **arguments: object) -> None:
        with one_stream(self.device):
            call_ext(self.ext, name, **arguments)

    def _decode(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """exl3_moe_coop over (tokens <= 8, top_k) slots; returns a view of the fp32 output buffer."""
        top_k = ids.shape[1]
        if top_k not in self.coop:
            self.coop[top_k] = _CoopScratch.allocate(top_k, self.width, self.intermediate, self.device)
        s = self.coop[top_k]
        self._launch(
            # The expert range makes a slot of id -1 (not this rank's) inactive whatever its weight: with
            # min_expert -1 the kernel would index the tables at -1 (exl3_moe_coop_kernel.cuh, slot_info).
            "exl3_moe_coop", x=hidden, sel=ids, rw=weights, min_expert=0, max_expert=self.num_experts, Hi=self.width,
            **self._tables({"gate": "g", "up": "u", "down": "d"}, {part: part for part in PARTS}),
            g_bias=None, u_bias=None, d_bias=None, Kg=self.k["gate"], Ku=self.k["up"], Kd=self.k["down"],
            mcg=self.mcg, mul1=self.mul1, act=ACT_SILU, act_limit=0.0, gated=True,
            had_g=s.had_g, had_u=s.had_u, gu_g=s.gu_g, gu_u=s.gu_u, act_out=s.act_out, d_out=s.d_out, ctr=s.ctr,
            out=s.out, sh_out=None, sh_gate_w=None,
        )
        return s.out[: hidden.shape[0]]

    def _prefill(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """exl3_moe over at most MOE_ROWS tokens (so no expert exceeds the temp rows), every slot written once
        into a scratch and summed per token in k order by exl3_moe_gather. Device ops only: no count read back.
        A slot of id -1 (not this rank's) goes to exllamav3's sentinel bin, expert_count's last entry, which
        exl3_moe ignores; exl3_moe_gather skips an expert outside [0, num_experts)."""
        tokens, top_k = ids.shape
        flat = torch.where(ids >= 0, ids, self.num_experts).reshape(-1)
        order = torch.argsort(flat, stable=True)
        inv_order = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
        token_sorted = torch.div(torch.arange(flat.numel(), device=flat.device), top_k, rounding_mode="floor")[order]
        weight_sorted = weights.reshape(-1)[order].contiguous()
        count = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=flat.device)
        count.scatter_add_(0, flat, torch.ones_like(flat))
        start = torch.cumsum(count, 0) - count
        output = torch.zeros(tokens, self.width, dtype=torch.float32, device=hidden.device)
        scratch = torch.empty(flat.numel(), self.width, dtype=torch.float32, device=hidden.device)
        temps = _moe_temps(self.ext, self.device, self.width, self.intermediate)
        self._launch(
            "exl3_moe", hidden_state=hidden, output_state=output, expert_count=count,
            token_sorted=token_sorted, weight_sorted=weight_sorted, temp_state_g=temps[0], temp_state_u=temps[1],
            temp_intermediate_g=temps[2], temp_intermediate_u=temps[3], act_function=ACT_SILU,
            K_gate=self.k["gate"], K_up=self.k["up"], K_down=self.k["down"],
            **self._tables({p: p for p in PROJECTIONS}, {part: f"ptrs_{part}" for part in PARTS}),
            **{f"{p}_{flag}": value for p in PROJECTIONS for flag, value in (("mcg", self.mcg), ("mul1", self.mul1))},
            act_limit=0.0, num_active=-1, output_scratch=scratch, fused_base=start, count_lo=1, count_hi=MOE_ROWS,
            m_tile=16,
        )
        experts = slice(0, self.num_experts)
        self._launch(
            "exl3_moe_gather", output_state=output, output_scratch=scratch, flat_expert=flat,
            inv_order=inv_order, expert_start=start[experts], slot_base=start[experts],
            slot_kind=torch.full((self.num_experts,), FUSED_SLOTS, dtype=torch.int64, device=flat.device),
            weight_sorted=weight_sorted,
        )
        return output

    def warm_up(self, top_k: int) -> None:
        """Run exl3_moe_coop at every decode batch size and exl3_moe once, outside graph capture (the first launch
        allocates exllamav3's barrier buffer, and each kernel instance sets its attributes on first use). Called
        during vLLM's profile run."""
        self.warm = True
        for tokens in range(1, COOP_MAX_TOKENS + 2):
            ids = torch.arange(tokens * top_k, device=self.device).reshape(tokens, top_k) % self.num_experts
            weights = torch.ones(tokens, top_k, dtype=torch.float16, device=self.device)
            hidden = torch.zeros(tokens, self.width, dtype=torch.float16, device=self.device)
            (self._decode if tokens <= COOP_MAX_TOKENS else self._prefill)(hidden, weights, ids)


class Exllamav3Linear(RotatedLinear):
    """Dense EXL3 linears through `exl3_gemm`: the shared shard handling and custom op of RotatedLinear, with the
    product (rotations included) done by exllamav3."""

    def __init__(self, shards: Sequence[LinearShard], device: torch.device, capture_rows: Sequence[int] = (),
                 ext: ModuleType | None = None) -> None:
        refusal = linear_refusal(shards)
        if refusal is not None:
            raise InvalidValueError(f"the exllamav3 backend cannot compute this linear: {refusal}")
        super().__init__(shards, device, backend=None)  # shard_product below replaces the launcher
        self.ext = ext if ext is not None else load_ext()
        self.device = device
        self.capture_rows = tuple(capture_rows)  # the batch sizes vLLM will capture CUDA graphs for
        self.warm = False

    def shard_product(self, cover: torch.Tensor, shard: LinearShard, table: MatrixTable) -> torch.Tensor:
        layer = shard.layer
        a = cover.to(torch.float16).contiguous()
        out = torch.empty(a.shape[0], layer.out_features, dtype=torch.float32, device=a.device)
        with one_stream(self.device):
            call_ext(self.ext, "exl3_gemm", A=a, B=layer.trellis, C=out, suh=layer.suh, A_had=torch.empty_like(a),
                     svh=layer.svh, force_shape_idx=-1, mcg=layer.codebook == Codebook.MCG,
                     mul1=layer.codebook == Codebook.MUL1, force_num_sms=0)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if PHASE.profiling and not self.warm:
            self.warm_up(self.capture_rows)
        return super().forward(x)

    def warm_up(self, row_counts: Sequence[int]) -> None:
        """Autotune exl3_gemm for every row count vLLM will capture (it tunes per shape, with stream
        synchronisation that graph capture forbids). Called during vLLM's profile run."""
        self.warm = True
        for rows in row_counts:
            super().forward(torch.zeros(rows, self.shards[0].in_size, dtype=torch.float16, device=self.device))


BACKEND = Backend(
    name="exllamav3", description="exllamav3's CUDA kernels", auto_on=("cuda",), graph_safe=True,
    unavailable=exllamav3_unavailable,
    build_moe=lambda layer: Exllamav3MoE(layer.experts, layer.tables, layer.arena, layer.crop, layer.device),
    moe_refusal=lambda layer: moe_refusal(layer.experts, layer.crop, layer.swiglu_limit),
    build_linear=lambda layer: Exllamav3Linear(layer.shards, layer.device, layer.capture_rows),
    linear_refusal=lambda layer: linear_refusal(layer.shards),
)
