"""Which rows of a batch each program of the EXL3 matmul kernel takes, and which matrix it reads.

Both layouts are built from device tensors with device ops only (no `.item()`, `nonzero`, `unique`, no
boolean indexing) and have sizes that depend on the batch shape alone, so they run inside CUDA graphs:
- per row: one row per block, for decode, where a slot's expert is rarely shared and grouping would
  cost more than it saves;
- grouped: rows sorted by matrix into blocks of `block_m` (the role of vLLM's `moe_align_block_size`),
  so each trellis tile is decoded once per block of tokens in prefill. The block count is the worst case
  ceil(rows / block_m) + matrices; blocks past the used ones carry matrix -1 and exit at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_row_blocks(matrix_of_row: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_ids int32 (rows * block_m,), block_matrix int32 (rows,)): block r holds row r alone."""
    rows = matrix_of_row.shape[0]
    row_ids = torch.full((rows, block_m), -1, dtype=torch.int32, device=matrix_of_row.device)
    row_ids[:, 0] = torch.arange(rows, dtype=torch.int32, device=matrix_of_row.device)
    return row_ids.reshape(-1), matrix_of_row.to(torch.int32)


def single_matrix_blocks(rows: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_ids, block_matrix) for a dense linear: consecutive rows in blocks of `block_m`, all matrix 0."""
    blocks = -(-rows // block_m)
    row_ids = torch.arange(blocks * block_m, dtype=torch.int32, device=device)
    row_ids = torch.where(row_ids < rows, row_ids, -1)
    return row_ids, torch.zeros(blocks, dtype=torch.int32, device=device)


def _sunk(matrix_of_row: torch.Tensor, num_matrices: int) -> torch.Tensor:
    """int64 ids with every -1 (a row no matrix of this launch takes: another expert-parallel rank's expert) moved
    to a sink id `num_matrices` past the real ones, so that counting and sorting leave it last and drop it."""
    return matrix_of_row.to(torch.int64).remainder(num_matrices + 1)  # one op: -1 -> num_matrices, ids unchanged


def slot_counts(matrix_of_row: torch.Tensor, num_matrices: int) -> torch.Tensor:
    """int64 (num_matrices,): how many rows each matrix has (rows of matrix -1 are no matrix's)."""
    ids = _sunk(matrix_of_row, num_matrices)
    counts = torch.zeros(num_matrices + 1, dtype=torch.int64, device=matrix_of_row.device)
    return counts.scatter_add_(0, ids, torch.ones_like(ids))[:num_matrices]


def grouped_blocks(
    matrix_of_row: torch.Tensor, num_matrices: int, block_m: int, counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_ids, block_matrix): rows of each matrix packed into consecutive blocks, in row order; rows of matrix -1
    in no block. `counts`: the rows' `slot_counts` where the caller has them already."""
    device = matrix_of_row.device
    ids = _sunk(matrix_of_row, num_matrices)
    rows = ids.shape[0]
    max_blocks = -(-rows // block_m) + num_matrices
    if counts is None:
        counts = slot_counts(ids, num_matrices)
    blocks_per_matrix = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks_per_matrix, 0)
    row_start = torch.cumsum(counts, 0) - counts  # first sorted position of each matrix's rows
    # The sunk rows (sorted last) rank from 0 in a sink block past the real ones, sliced off below.
    row_start = F.pad(row_start, (0, 1))
    block_start = F.pad(block_end - blocks_per_matrix, (0, 1), value=max_blocks)
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    rank = torch.arange(rows, device=device) - row_start[sorted_ids]
    position = block_start[sorted_ids] * block_m + rank
    row_ids = torch.full((max_blocks * block_m + rows,), -1, dtype=torch.int32, device=device)
    row_ids[position] = order.to(torch.int32)
    row_ids = row_ids[: max_blocks * block_m]
    block_matrix = torch.searchsorted(block_end, torch.arange(max_blocks, device=device), right=True)
    block_matrix = torch.where(block_matrix < num_matrices, block_matrix, -1)
    return row_ids, block_matrix.to(torch.int32)


def blocks_where(block_matrix: torch.Tensor, counts: torch.Tensor, min_rows: int, at_least: bool) -> torch.Tensor:
    """`block_matrix` with -1 (skip) on every block whose matrix has fewer than `min_rows` rows (`at_least`), or at
    least that many (not `at_least`): two launches share one batch, each taking its matrices' blocks."""
    matrix = block_matrix.to(torch.int64).clamp(min=0)
    many = counts[matrix] >= min_rows
    keep = (block_matrix >= 0) & (many if at_least else ~many)
    return torch.where(keep, block_matrix, -1)
