"""Which rounding this torch build's CPU kernels use, for tests whose exact-equality claims depend on it."""

from __future__ import annotations

import torch

from vllm_expert_offload.exl3 import Codebook
from vllm_expert_offload.exl3.codebook import codebook_table


def torch_addcmul_fuses() -> bool:
    """Whether torch.addcmul rounds once (a fused multiply-add), as its AVX2/AVX-512 kernels do; at CPU capability
    DEFAULT it rounds twice, so the torch encoder's states then differ from the compiled one's, which always fuses."""
    values = codebook_table(Codebook.MUL1).float()
    x2 = torch.tensor([[-2.0 * 0.7371]])
    fused = (values.double() * values.double() + values.double() * x2.double()).float()
    return torch.equal(torch.addcmul(values * values, values, x2), fused)
