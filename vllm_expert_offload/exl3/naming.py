"""Where each architecture keeps its routed and shared experts in an exllamav3 checkpoint (exl3-format.md §1.4)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .deepseek_v4 import HEAD as DSV4_HEAD
from .errors import Exl3FormatError

PROJECTIONS = ("gate", "up", "down")
HEAD = "lm_head"
HEADS = (HEAD, DSV4_HEAD)  # the output head's module name: HF naming, DeepSeek-V4's native naming
# Module names (last path component) of the linears exllamav3 gives a qmap, for every supported architecture.
LINEAR_LEAVES = frozenset(
    {
        "q_proj", "k_proj", "v_proj", "o_proj",  # attention
        "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",  # DeepSeek MLA
        "gate_proj", "up_proj", "down_proj",  # dense MLP, shared and routed experts
        "w1", "w2", "w3",  # Mixtral and DeepSeek-V4 experts (gate, down, up)
        "wq_a", "wq_b", "wkv", "wo_a", "wo_b", "wgate", "weights_proj",  # DeepSeek-V4 attention, compressors
    }
)


@dataclass(frozen=True)
class MoeLayout:
    """Tensor names and sizes of one MoE architecture, read from its HF config."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert, unpadded
    moe_layers: tuple[int, ...]
    expert_root: str  # "model.layers.{layer}.mlp.experts"
    projection_names: Mapping[str, str]  # gate/up/down -> checkpoint name
    shared_expert_root: str | None = None
    shared_intermediate_size: int | None = None

    def expert_prefix(self, layer: int, expert: int, projection: str) -> str:
        return f"{self.expert_root.format(layer=layer)}.{expert}.{self.projection_names[projection]}"

    def shared_prefix(self, layer: int, projection: str) -> str | None:
        if self.shared_expert_root is None:
            return None
        return f"{self.shared_expert_root.format(layer=layer)}.{self.projection_names[projection]}"

    def expert_layer(self, prefix: str) -> int | None:
        """The layer of a routed-expert module name (any layer index, draft layers included); None otherwise."""
        root = re.escape(self.expert_root).replace(r"\{layer\}", r"(\d+)")
        match = re.match(rf"^{root}\.\d+\.", prefix + ".")
        return None if match is None else int(match.group(1))

    def expert_shape(self, projection: str) -> tuple[int, int]:
        """(in_features, out_features) of one routed expert projection, unpadded."""
        if projection == "down":
            return self.intermediate_size, self.hidden_size
        return self.hidden_size, self.intermediate_size


def _require(config: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        if key in config and config[key] is not None:
            return config[key]
    raise Exl3FormatError(f"config.json: missing {' or '.join(keys)}")


def _qwen3_moe(cfg: Mapping[str, Any], arch: str) -> MoeLayout:
    layers = int(cfg["num_hidden_layers"])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers", []) or [])
    experts = int(_require(cfg, "num_experts", "num_local_experts"))  # transformers 5 writes the latter
    moe = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    return MoeLayout(
        arch, int(cfg["hidden_size"]), layers, experts, int(cfg["num_experts_per_tok"]),
        int(cfg["moe_intermediate_size"]), moe, "model.layers.{layer}.mlp.experts",
        {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    )


def _mixtral(cfg: Mapping[str, Any], arch: str) -> MoeLayout:
    layers = int(cfg["num_hidden_layers"])
    return MoeLayout(
        arch, int(cfg["hidden_size"]), layers, int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]),
        int(cfg["intermediate_size"]), tuple(range(layers)), "model.layers.{layer}.block_sparse_moe.experts",
        {"gate": "w1", "up": "w3", "down": "w2"},
    )


def _deepseek(cfg: Mapping[str, Any], arch: str) -> MoeLayout:
    layers = int(cfg["num_hidden_layers"])
    first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
    freq = int(cfg.get("moe_layer_freq", 1) or 1)
    moe = tuple(i for i in range(layers) if i >= first_dense and i % freq == 0)
    shared = int(cfg.get("n_shared_experts", 0) or 0)
    inter = int(cfg["moe_intermediate_size"])
    return MoeLayout(
        arch, int(cfg["hidden_size"]), layers, int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"]),
        inter, moe, "model.layers.{layer}.mlp.experts",
        {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
        shared_expert_root="model.layers.{layer}.mlp.shared_experts" if shared else None,
        shared_intermediate_size=inter * shared if shared else None,
    )


def _deepseek_v4(cfg: Mapping[str, Any], arch: str) -> MoeLayout:
    """exllamav3's DeepSeek-V4 names (exl3/deepseek_v4.py): every layer MoE with one shared expert block; the
    draft layers (`mtp.N`) sit outside `layers.` and are the draft model's."""
    layers = int(cfg["num_hidden_layers"])
    inter = int(cfg["moe_intermediate_size"])
    shared = int(cfg.get("n_shared_experts", 1) or 0)
    return MoeLayout(
        arch, int(cfg["hidden_size"]), layers, int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"]),
        inter, tuple(range(layers)), "layers.{layer}.ffn.experts", {"gate": "w1", "up": "w3", "down": "w2"},
        shared_expert_root="layers.{layer}.ffn.shared_experts" if shared else None,
        shared_intermediate_size=inter * shared if shared else None,
    )


def _deepseek_v41(cfg: Mapping[str, Any], arch: str) -> MoeLayout:
    """DeepSeek-V4.1 keeps DeepSeek-V4's native expert names (`layers.L.ffn.experts.E.w{1,3,2}`, one shared expert
    block, every layer MoE; vLLM 0.32's V4.1 mapper re-roots them under `language_model.model.`), but its
    config.json nests the text model's fields under `text_config`: flattened onto the top level first, as vLLM's
    DeepseekV41Config does (transformers_utils/configs/deepseek_v41.py)."""
    return _deepseek_v4({**cfg, **(cfg.get("text_config") or {})}, arch)


_LAYOUTS = {
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "MixtralForCausalLM": _mixtral,
    "DeepseekV2ForCausalLM": _deepseek,
    "DeepseekV3ForCausalLM": _deepseek,
    "DeepseekV4ForCausalLM": _deepseek_v4,
    "DeepseekV41ForCausalLM": _deepseek_v41,
}
SUPPORTED_ARCHITECTURES = tuple(_LAYOUTS)


def moe_layout(hf_config: Mapping[str, Any]) -> MoeLayout | None:
    """The layout of a supported MoE architecture; None for any other architecture (dense linears only)."""
    for arch in hf_config.get("architectures") or []:
        if arch in _LAYOUTS:
            try:
                return _LAYOUTS[arch](hf_config, arch)
            except (KeyError, TypeError, ValueError) as exc:
                raise Exl3FormatError(f"config.json: {arch} config is incomplete or malformed ({exc!r})") from exc
    return None
