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
    # Draft (MTP / DSpark) layers stored outside the main stack ("mtp.{stage}.ffn.experts"): vLLM builds them as
    # layers num_layers + stage, so a layer index past the main stack names a draft stage's experts.
    draft_expert_root: str | None = None
    draft_experts: int = 0  # routed experts per draft layer (DeepSeek-V4.1's DSpark: dspark_n_routed_experts)

    def expert_prefix(self, layer: int, expert: int, projection: str) -> str:
        """The checkpoint name of one routed expert projection; layer >= num_layers is draft stage
        layer - num_layers, which the checkpoint keeps under its own root (vLLM's `mtp.i` -> `layers.{n+i}`
        rename, read back)."""
        if self.draft_expert_root is not None and layer >= self.num_layers:
            root = self.draft_expert_root.format(stage=layer - self.num_layers)
        else:
            root = self.expert_root.format(layer=layer)
        return f"{root}.{expert}.{self.projection_names[projection]}"

    def shared_prefix(self, layer: int, projection: str) -> str | None:
        if self.shared_expert_root is None:
            return None
        return f"{self.shared_expert_root.format(layer=layer)}.{self.projection_names[projection]}"

    def expert_layer(self, prefix: str) -> int | None:
        """The layer of a routed-expert module name, draft stages as num_layers + stage (how vLLM numbers them);
        None for anything else."""
        for root, offset in ((self.expert_root, 0), (self.draft_expert_root, self.num_layers)):
            if root is None:
                continue
            pattern = re.escape(root).replace(r"\{layer\}", r"(\d+)").replace(r"\{stage\}", r"(\d+)")
            match = re.match(rf"^{pattern}\.\d+\.", prefix + ".")
            if match:
                return offset + int(match.group(1))
        return None

    def is_draft_layer(self, layer: int) -> bool:
        return self.draft_expert_root is not None and layer >= self.num_layers

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


def _deepseek_v4(cfg: Mapping[str, Any], arch: str, draft_experts: int | None = None) -> MoeLayout:
    """exllamav3's DeepSeek-V4 names (exl3/deepseek_v4.py): every layer MoE with one shared expert block; the
    draft layers (`mtp.N`) sit outside `layers.` and are the draft model's (vLLM's MTP/DSpark drafters build them
    as layers num_hidden_layers + N)."""
    layers = int(cfg["num_hidden_layers"])
    inter = int(cfg["moe_intermediate_size"])
    shared = int(cfg.get("n_shared_experts", 1) or 0)
    experts = int(cfg["n_routed_experts"])
    return MoeLayout(
        arch, int(cfg["hidden_size"]), layers, experts, int(cfg["num_experts_per_tok"]),
        inter, tuple(range(layers)), "layers.{layer}.ffn.experts", {"gate": "w1", "up": "w3", "down": "w2"},
        shared_expert_root="layers.{layer}.ffn.shared_experts" if shared else None,
        shared_intermediate_size=inter * shared if shared else None,
        draft_expert_root="mtp.{stage}.ffn.experts", draft_experts=draft_experts or experts,
    )


def _deepseek_v41(cfg: Mapping[str, Any], arch: str) -> MoeLayout:
    """DeepSeek-V4.1 keeps DeepSeek-V4's native expert names (`layers.L.ffn.experts.E.w{1,3,2}`, one shared expert
    block, every layer MoE; vLLM 0.32's V4.1 mapper re-roots them under `language_model.model.`), but its
    config.json nests the text model's fields under `text_config`: flattened onto the top level first, as vLLM's
    DeepseekV41Config does (transformers_utils/configs/deepseek_v41.py). Its DSpark draft layers have their own
    expert count (`dspark_n_routed_experts`, vLLM's DeepseekV4MoE for layers past num_hidden_layers)."""
    text = {**cfg, **(cfg.get("text_config") or {})}
    return _deepseek_v4(text, arch, draft_experts=int(text.get("dspark_n_routed_experts") or 0) or None)


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
