"""The MXINT-4 engram lookup returns exactly the rows a reference decode of the stored bytes gives, per rank of a
head-sharded table, with vLLM's zeros for padding heads and ids outside the rank's rows.

The reference decodes every byte from the format's definition in plain Python (two's-complement nibbles, the even
column in the low nibble; E4M3 from its sign, exponent and mantissa bits, divided by the writer's prescale 8), so
it shares no code with the lookup or with torch's float8 conversion.
"""

from __future__ import annotations

import torch

from vllm_expert_offload.exl3.engram import EngramFormat, dequantize_rows
from vllm_expert_offload.kernels.engram_lookup import lookup_mxint4

DIM = 64
HEADS = (11, 13, 17, 19, 23)  # prime-sized bucket ranges, as vLLM's EngramLayout draws them


def _e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def _reference_row(codes: torch.Tensor, scales: torch.Tensor, row: int) -> list[float]:
    out = []
    for col in range(DIM):
        byte = int(codes[row, col // 2])
        nibble = byte & 0xF if col % 2 == 0 else byte >> 4
        out.append((nibble - 16 if nibble >= 8 else nibble) * _e4m3(int(scales[row, col // 32])) / 8)
    return out


def _table(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = sum(HEADS)
    codes = torch.randint(0, 256, (rows, DIM // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (rows, DIM // 32), generator=gen, dtype=torch.uint8)  # finite e4m3, subnormals too
    return codes, scales


def test_rows_equal_the_reference_decode_on_every_rank() -> None:
    codes, scales = _table()
    gen = torch.Generator().manual_seed(1)
    starts = [sum(HEADS[:h]) for h in range(len(HEADS))]
    indices = torch.stack([torch.randint(s, s + n, (7,), generator=gen) for s, n in zip(starts, HEADS)], dim=1)
    for tp in (1, 2):
        per_rank = -(-len(HEADS) // tp)
        gathered = []
        for rank in range(tp):
            first = rank * per_rank
            lo, hi = sum(HEADS[:first]), sum(HEADS[:first + per_rank])
            out = torch.full((7, per_rank, DIM), float("nan"), dtype=torch.bfloat16)
            lookup_mxint4(codes[lo:hi], scales[lo:hi], indices, out, head_start=first, local_heads=per_rank,
                          vocab_start=lo)
            gathered.append(out)
        rows = torch.cat(gathered, dim=1)[:, :len(HEADS)]
        for token in range(7):
            for head in range(len(HEADS)):
                want = torch.tensor(_reference_row(codes, scales, int(indices[token, head])))
                assert torch.equal(rows[token, head], want.to(torch.bfloat16)), (tp, token, head)
        if tp == 2:  # rank 1 holds 2 real heads and a padding head of zeros
            assert torch.equal(gathered[1][:, 2], torch.zeros(7, DIM, dtype=torch.bfloat16))


def test_ids_outside_the_rank_are_zero_and_reference_helpers_agree() -> None:
    codes, scales = _table(3)
    indices = torch.tensor([[0, 40], [sum(HEADS) - 1, 5]])
    out = torch.empty(2, 2, DIM, dtype=torch.bfloat16)
    lookup_mxint4(codes[:24], scales[:24], indices, out, head_start=0, local_heads=2, vocab_start=0)
    assert torch.equal(out[0, 1], torch.zeros(DIM, dtype=torch.bfloat16))  # id 40 is not in rows 0..23
    assert torch.equal(out[1, 0], torch.zeros(DIM, dtype=torch.bfloat16))
    assert torch.equal(out[0, 0].float(), dequantize_rows(EngramFormat.MXINT4, codes[:1], scales[:1])[0].bfloat16().float())
    assert torch.equal(dequantize_rows(EngramFormat.MXINT4, codes[5:6], scales[5:6])[0],
                       torch.tensor(_reference_row(codes, scales, 5)))
