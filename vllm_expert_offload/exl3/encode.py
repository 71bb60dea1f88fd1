"""No-Hessian EXL3 encoder: incoherence rotation plus a tail-biting trellis Viterbi per 16x16 tile.

This is exllamav3's `fallback_quant` path (exl3-format.md §3.2): correct bits for every kernel, but a higher
Hessian-weighted error than LDLQ, so it serves test models and fixtures, not production checkpoints.
Everything runs on the CPU; the Viterbi search, about O(256 * 2^16) per tile and pass whatever K, runs in the
compiled extension (vllm_expert_offload/csrc/exl3_viterbi.inc) when it builds, else in torch here. Both give the same states bit for
bit where torch.addcmul is a fused multiply-add (its AVX2/AVX-512 kernels); at torch's CPU capability DEFAULT it
rounds twice, so the torch states differ there, while the compiled encoder's are the same on every CPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import cache, lru_cache

import torch

from ..errors import ExpertOffloadError, InvalidValueError
from .bitrate import HALF_K, INTEGER_K, POSITIONS, check_k_codebook, position_bits
from .codebook import Codebook, codebook_table
from .errors import Exl3FormatError
from .hadamard import hadamard_last, hadamard_rows
from .ring import pack_states
from .tensors import Exl3Linear, padded
from .tile import tiles_to_positions

logger = logging.getLogger("vllm.expert_offload")

# "compiled" (refuse without the extension), "torch" (tests compare the two), or unset/"auto": compiled if built.
VITERBI_ENV = "VLLM_EXPERT_OFFLOAD_VITERBI"
VITERBI_BACKENDS = ("auto", "compiled", "torch")
# (targets, int32 position bits, fp32 codebook values) -> states: a compiled search, of the same contract as the
# torch one here. The format layer owns the table; the compiled CPU kernels (kernels/cpu_exl3.py, a layer above)
# register theirs when imported, the loader raising an ExpertOffloadError saying why it cannot run.
ViterbiSearch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_COMPILED_VITERBI: dict[str, Callable[[], ViterbiSearch]] = {}


def register_compiled_viterbi(name: str, load: Callable[[], ViterbiSearch]) -> None:
    """Offer a compiled Viterbi to the encoder; `load()` returns it or raises ExpertOffloadError with the reason."""
    _COMPILED_VITERBI[name] = load
STATE_BITS = 16
NUM_STATES = 1 << STATE_BITS
# Rows are first normalised to this RMS (3INST's table std, exllamav3's convention), then multiplied by g.
# exllamav3 divides by -1.24371088; the sign is immaterial next to the random su.
ROW_TARGET_RMS = 1.24371088
# Without a search: MUL1's table std is 1.0, not 1.24, hence its smaller g (exl3-format.md §3.2 step 4).
DEFAULT_SCALE = {Codebook.INST3: 1.0, Codebook.MCG: 1.0, Codebook.MUL1: 0.8}
SCALE_GRID = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2)
SCALE_SAMPLE_TILES = 8
# Tiles per compiled call and thread: a call returns every few tiles for the progress bar, and its slowest
# thread leaves the others idle for at most about one tile.
COMPILED_TILES_PER_THREAD = 4
# Tiles per torch Viterbi batch (one batch per worker thread): the two (T, 65536) fp32 cost buffers stay in
# cache, and backpointers take T * 256 * 2^(16-D) bytes (32 MB at K=1).
TILE_BATCH = 4
# Pass 1 starts half a ring away from position 0 so its arbitrary start has faded out by position 0.
PASS1_ROTATION = POSITIONS // 2


def encode_linear(
    weight: torch.Tensor,
    k: float,
    codebook: Codebook = Codebook.MUL1,
    *,
    name: str = "linear",
    bias: torch.Tensor | None = None,
    seed: int = 0,
    scale_search: bool = True,
    progress: Callable[[int], None] | None = None,
) -> Exl3Linear:
    """Quantize a torch.nn.Linear weight (out_features, in_features) to an EXL3 tensor set padded to 128.

    Zero rows and columns (the padding included) get a zero scale, so they decode to exact zeros.
    `seed` drives the random sign flips; the same seed gives bit-identical tensors.
    `progress(n)` receives the cumulative number of finished tiles.
    """
    k = _checked_k(k, codebook, name)
    w = _padded_kn(weight, name)
    su, sv = _random_signs(w.shape, seed)
    svh = _column_scales(w, sv).half()
    w = hadamard_last(w * _safe_reciprocal(svh)[None, :])
    su_base = su * w.pow(2).mean(1).sqrt() / ROW_TARGET_RMS
    g = _search_scale(w, su_base, k, codebook) if scale_search else DEFAULT_SCALE[codebook]
    suh = (su_base / g).half()
    w_hat = hadamard_rows(w * _safe_reciprocal(suh)[:, None])
    targets = tiles_to_positions(w_hat)
    states = encode_tiles(targets.reshape(-1, POSITIONS), k, codebook, progress=progress)
    trellis = pack_states(states.reshape(targets.shape), k)
    return Exl3Linear(
        name=name, trellis=trellis, suh=suh, svh=svh, codebook=codebook, k=k, bias=_padded_bias(bias, w.shape[1], name)
    )


def encode_tiles(
    targets: torch.Tensor,
    k: float,
    codebook: Codebook = Codebook.MUL1,
    *,
    progress: Callable[[int], None] | None = None,
    viterbi: str | None = None,
) -> torch.Tensor:
    """Best closed trellis path per tile: (T, 256) fp32 targets in ring order -> (T, 256) int64 states.

    The states form a consistent ring, so `unpack_states(pack_states(states, k), k) == states` and they decode
    to exactly `codebook_table(codebook)[states]`. `progress(n)` receives the cumulative finished tiles.
    `viterbi` is one of VITERBI_BACKENDS, by default the VITERBI_ENV environment variable's (benchmarks pick both).
    """
    values = codebook_table(codebook).float()
    compiled = compiled_viterbi(viterbi)
    if compiled is None:
        return _encode_tiles_torch(targets.float(), position_bits(k).tolist(), values, progress)
    bits = position_bits(k).to(torch.int32)
    out = torch.empty(targets.shape[0], POSITIONS, dtype=torch.int64)
    chunk = COMPILED_TILES_PER_THREAD * torch.get_num_threads()
    for start in range(0, targets.shape[0], chunk):
        end = min(start + chunk, targets.shape[0])
        out[start:end] = compiled(targets[start:end].float().contiguous(), bits, values)
        if progress is not None:
            progress(end)
    return out


def compiled_viterbi(viterbi: str | None = None) -> ViterbiSearch | None:
    """The compiled Viterbi (targets, int32 position bits, fp32 codebook values) -> states, or None when the
    torch one must run, logged once per reason: the extension needs a compiler, and a silent 20x slowdown of
    `quantize` would look like a hang. `viterbi` None reads VITERBI_ENV."""
    choice = viterbi or os.environ.get(VITERBI_ENV) or "auto"
    source = f"viterbi={choice}" if viterbi else f"{VITERBI_ENV}={choice}"
    if choice not in VITERBI_BACKENDS:
        raise InvalidValueError(f"{source}: expected one of {', '.join(VITERBI_BACKENDS)}")
    if choice == "torch":
        _log_torch_encoder(source)
        return None
    reasons = []
    for name, load in _COMPILED_VITERBI.items():
        try:
            return load()
        except ExpertOffloadError as exc:
            reasons.append(f"{name}: {exc}")
    why = "; ".join(reasons) or "none is registered (importing vllm_expert_offload.kernels.cpu_exl3 registers it)"
    if choice == "compiled":
        raise Exl3FormatError(f"{source}, but the compiled encoder is not available: {why}")
    _log_torch_encoder(f"the compiled encoder is unavailable: {why}")
    return None


@cache
def _log_torch_encoder(reason: str) -> None:
    logger.warning("EXL3 encoder: the torch Viterbi runs, far slower than the compiled one (%s)", reason)


def _encode_tiles_torch(
    targets: torch.Tensor, bits: list[int], values: torch.Tensor, progress: Callable[[int], None] | None
) -> torch.Tensor:
    batches = [targets[i : i + TILE_BATCH] for i in range(0, targets.shape[0], TILE_BATCH)]
    out = torch.empty(targets.shape[0], POSITIONS, dtype=torch.int64)
    done = 0
    with _one_thread_per_op() as workers, ThreadPoolExecutor(workers) as pool:
        for states in pool.map(lambda x: _tail_biting_viterbi(x, bits, values), batches):
            out[done : done + states.shape[0]] = states
            done += states.shape[0]
            if progress is not None:
                progress(done)
    return out


@contextmanager
def _one_thread_per_op() -> Iterator[int]:
    """Run torch single-threaded and parallelise over tile batches instead, yielding the worker count.

    Each Viterbi step is a handful of ~50 us ops; intra-op threads meet at a barrier after every one, so a
    single preempted thread stalls them all. On 2 cores shared with another process that made encoding 14x
    slower, while one batch per Python thread (torch releases the GIL) keeps full speed on an idle machine.
    The thread setting is process-wide, so other torch work in this process runs single-threaded meanwhile.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield threads
    finally:
        torch.set_num_threads(threads)


def _checked_k(k: float, codebook: Codebook, name: str) -> float:
    if k not in INTEGER_K and k not in HALF_K:
        raise Exl3FormatError(f"{name}: K={k} bits per weight; EXL3 encodes K in 1..8 or 1.5/2.5/3.5")
    check_k_codebook(k, codebook, name)
    return int(k) if k in INTEGER_K else k


def _padded_kn(weight: torch.Tensor, name: str) -> torch.Tensor:
    """nn.Linear weight -> fp32 (in, out) zero-padded to multiples of 128, the orientation EXL3 stores."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise Exl3FormatError(f"{name}: expected a 2-D float weight, got {weight.dtype} {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise Exl3FormatError(f"{name}: weight has non-finite values")
    n, k = weight.shape
    out = torch.zeros(padded(k), padded(n), dtype=torch.float32)
    out[:k, :n] = weight.detach().to(device="cpu", dtype=torch.float32).t()
    return out


def _padded_bias(bias: torch.Tensor | None, n_pad: int, name: str) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.numel() > n_pad:
        raise Exl3FormatError(f"{name}: bias has {bias.numel()} elements, more than the {n_pad} padded outputs")
    return torch.nn.functional.pad(bias.detach().reshape(-1).cpu().half(), (0, n_pad - bias.numel()))


def _random_signs(shape: torch.Size, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ±1 on both sides make the rotated weight incoherent (near-Gaussian) whatever its structure."""
    gen = torch.Generator().manual_seed(seed)
    su = torch.randint(0, 2, (shape[0],), generator=gen).float() * 2 - 1
    sv = torch.randint(0, 2, (shape[1],), generator=gen).float() * 2 - 1
    return su, sv


def _column_scales(w: torch.Tensor, sv: torch.Tensor) -> torch.Tensor:
    """sv times column RMS / mean: equalises output channels, and zero columns get scale 0 (decode to 0)."""
    rms = w.pow(2).mean(0).sqrt()
    nonzero = rms > 0
    mean = rms[nonzero].mean() if nonzero.any() else torch.tensor(1.0)
    return sv * rms / mean


def _safe_reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """1/scale, but 0 for a zero scale: such a row or column decodes to zero whatever its tiles hold."""
    scale = scale.float()
    return torch.where(scale != 0, 1.0 / torch.where(scale != 0, scale, 1.0), 0.0)


def _search_scale(w: torch.Tensor, su_base: torch.Tensor, k: float, codebook: Codebook) -> float:
    """Pick g from SCALE_GRID by the error on a few evenly spread tiles of the g = 1 rotated weight: the best
    g depends on K and on the codebook's value distribution, not just on its std."""
    w_hat_unit = hadamard_rows(w * _safe_reciprocal(su_base)[:, None])
    tiles = tiles_to_positions(w_hat_unit).reshape(-1, POSITIONS)
    sample = tiles[torch.linspace(0, tiles.shape[0] - 1, min(SCALE_SAMPLE_TILES, tiles.shape[0])).long()]
    grid = torch.tensor(SCALE_GRID)
    scaled = (grid[:, None, None] * sample[None]).reshape(-1, POSITIONS)
    states = encode_tiles(scaled, k, codebook).reshape(len(SCALE_GRID), -1, POSITIONS)
    decoded = codebook_table(codebook).float()[states] / grid[:, None, None]
    errors = (decoded - sample[None]).pow(2).sum((1, 2))
    return SCALE_GRID[int(errors.argmin())]


def _tail_biting_viterbi(x: torch.Tensor, bits: list[int], values: torch.Tensor) -> torch.Tensor:
    """Two passes: a free pass over the ring rotated by half finds the in-edge e0 of position 0; the second
    pass starts on e0 and must end on a state whose low 16 - D(0) bits are e0, which closes the ring."""
    rotated_bits = bits[PASS1_ROTATION:] + bits[:PASS1_ROTATION]
    rotated = _viterbi(x.roll(-PASS1_ROTATION, 1), rotated_bits, values, start_edge=None)
    e0 = rotated[:, POSITIONS - PASS1_ROTATION] >> bits[0]
    return _viterbi(x, bits, values, start_edge=e0)


def _viterbi(x: torch.Tensor, bits: list[int], values: torch.Tensor, start_edge: torch.Tensor | None) -> torch.Tensor:
    """Min-squared-error state path over positions in the given order, (T, L) -> (T, L) states.

    state_i = ((state_{i-1} << D_i) | code_i) & 0xFFFF, so the edge e = state_i >> D_i equals the low 16 - D_i
    bits of state_{i-1}. With start_edge, position 0's edge is forced and the last state's low 16 - D_0 bits
    must equal it; without, both ends are free. Costs omit x_i^2, a per-position constant.
    """
    t, length = x.shape
    x2 = -2.0 * x
    squares = values * values
    cost = torch.empty(t, NUM_STATES)
    spare = torch.empty_like(cost)
    _add_position_cost(cost, _start_edge_costs(start_edge, t, bits[0]), squares, values, x2[:, 0:1], bits[0])
    backpointers: list[torch.Tensor] = []
    for i in range(1, length):
        edge_cost, argmin = _edge_min(cost, bits[i])
        backpointers.append(argmin)
        _add_position_cost(spare, edge_cost, squares, values, x2[:, i : i + 1], bits[i])
        cost, spare = spare, cost
    return _trace_back(_final_state(cost, start_edge, bits[0]), backpointers, bits)


def _start_edge_costs(start_edge: torch.Tensor | None, t: int, d: int) -> torch.Tensor:
    edges = 1 << (STATE_BITS - d)
    if start_edge is None:
        return torch.zeros(t, edges)
    costs = torch.full((t, edges), float("inf"))
    costs[torch.arange(t), start_edge] = 0.0
    return costs


def _add_position_cost(
    out: torch.Tensor, edge_cost: torch.Tensor, squares: torch.Tensor, values: torch.Tensor, x2: torch.Tensor, d: int
) -> None:
    """out[s] = cb[s]^2 - 2 x cb[s] + edge_cost[s >> d]; states s = (e << d) | code share edge e."""
    torch.addcmul(squares, values, x2, out=out)
    out.view(out.shape[0], -1, 1 << d).add_(edge_cost.unsqueeze(-1))


def _edge_min(cost: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each edge e (low 16 - d bits of the predecessor), the cheapest of its 2^d predecessors t*2^(16-d) + e.

    The argmin comes from an equality mask rather than torch.min(dim): that reduction over a strided
    dim is about 3x slower on CPU. Ties resolve to the largest t, deterministically.
    """
    by_top = cost.view(cost.shape[0], 1 << d, -1)
    edge_cost = by_top.amin(1)
    argmin = ((by_top == edge_cost.unsqueeze(1)) * _top_bit_values(d)).amax(1)
    return edge_cost, argmin


@lru_cache(maxsize=None)
def _top_bit_values(d: int) -> torch.Tensor:
    return torch.arange(1 << d, dtype=torch.uint8).view(1, -1, 1)


def _final_state(cost: torch.Tensor, start_edge: torch.Tensor | None, d0: int) -> torch.Tensor:
    if start_edge is None:
        return cost.argmin(1)
    edges = 1 << (STATE_BITS - d0)
    closing = cost.view(cost.shape[0], 1 << d0, edges).gather(2, start_edge.view(-1, 1, 1).expand(-1, 1 << d0, 1))
    return closing.squeeze(2).argmin(1) * edges + start_edge


def _trace_back(last: torch.Tensor, backpointers: list[torch.Tensor], bits: list[int]) -> torch.Tensor:
    rows = torch.arange(last.shape[0])
    states = torch.empty(last.shape[0], len(bits), dtype=torch.int64)
    state = last
    states[:, -1] = state
    for i in range(len(bits) - 1, 0, -1):
        edge = state >> bits[i]
        top = backpointers[i - 1][rows, edge].long()
        state = (top << (STATE_BITS - bits[i])) | edge
        states[:, i - 1] = state
    return states
