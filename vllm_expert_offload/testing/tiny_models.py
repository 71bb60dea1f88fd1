"""Tiny EXL3 MoE checkpoints built at test time: random HF weights -> EXL3, with a locally trained tokenizer.

Nothing is downloaded. Builds are cached under a content hash (architecture, options, the code that builds
them and every format-layer module it imports, the Viterbi search that ran and the compiled one's C++ sources,
library and Python versions), so a test session pays for each fixture once and a code change rebuilds it.

Sizes are chosen so that every quantized dim splits into 128-element Hadamard blocks at tensor-parallel 2,
and attention head dims are ones vLLM's CPU attention supports; `config_overrides` departs from that on purpose
(e.g. an expert intermediate size whose TP share cuts through a block).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import os
import platform
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..exl3.checkpoint import split_name
from ..exl3.codebook import Codebook
from ..exl3.convert import BLOCK_FP8_SCALE, convert_checkpoint, write_dense_twin
from ..exl3.encode import compiled_viterbi
from ..exl3.naming import HEAD, LINEAR_LEAVES
from ..kernels import cpu_exl3  # also offers the compiled Viterbi to the encoder

CACHE_ENV = "VLLM_EXPERT_OFFLOAD_FIXTURE_CACHE"
DEFAULT_CACHE = Path("~/.cache/vllm-expert-offload/fixtures")

_COMMON: dict[str, Any] = {"num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 2048,
                           "tie_word_embeddings": False, "num_experts_per_tok": 2,
                           # 5x transformers' 0.02: sharper logits, so greedy steps are decided by margins far
                           # above float32 rounding and token-level comparisons run the whole sequence.
                           "initializer_range": 0.1}
# transformers model_type -> config overrides.
ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": _COMMON | {
        "hidden_size": 128, "num_experts": 8, "moe_intermediate_size": 256, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    "mixtral": _COMMON | {
        "hidden_size": 256, "num_local_experts": 8, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 4,  # head_dim 256 / 4 = 64
    },
    "deepseek_v3": _COMMON | {
        "hidden_size": 256, "first_k_dense_replace": 1, "intermediate_size": 512, "n_routed_experts": 8,
        "n_shared_experts": 1, "moe_intermediate_size": 256, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.5,
        # What HF's DeepseekV3 always does, spelled out as published configs do: vLLM reads these keys and
        # would otherwise default to softmax scoring without the routing bias.
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        # 8 heads, not 4: q_proj has heads * (64 + 32) outputs, and only 8 heads give 128-multiples per TP-2 rank.
        # q_lora_rank None: vLLM then keeps q_proj and kv_a_proj_with_mqa separate instead of fusing
        # q_a_proj with kv_a_proj_with_mqa into one module (fused_qkv_a_proj) of two differently padded shards.
        "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": None, "kv_lora_rank": 128,
        "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
    },
}
ARCHITECTURES = tuple(ARCH_CONFIGS)
# transformers 5 saves some keys under its own new names; fixtures use the names published checkpoints have.
HUB_CONFIG_KEYS: dict[str, dict[str, str]] = {"qwen3_moe": {"num_local_experts": "num_experts"}}
MODEL_DTYPE = torch.bfloat16
# DeepSeek's routing bias starts at zero in transformers; a small random one makes its handling observable.
ROUTING_BIAS_STD = 0.05

# Tokenizer: byte-level BPE trained on ~29 KB of English prose and Python docs from the standard library.
TOKENIZER_VOCAB = 780
CORPUS_CHARS = 29_000
CORPUS_MODULES = ("json", "textwrap", "collections", "functools", "itertools", "string", "heapq")
BOS, EOS, PAD = "<|endoftext|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT_SAMPLE = """<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
Write a function that adds two numbers.<|im_end|>
<|im_start|>assistant
def add(a, b):
    return a + b<|im_end|>
"""


def fixture_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def _corpus() -> str:
    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen of Python
        import this
    texts = ["".join(this.d.get(c, c) for c in this.s), CHAT_SAMPLE]
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        texts.append(inspect.getdoc(module) or "")
        for attr, obj in sorted(vars(module).items()):
            if not attr.startswith("_") and getattr(obj, "__module__", None) == module.__name__:
                texts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(t for t in texts if t)[:CORPUS_CHARS]


def write_tokenizer(out_dir: Path) -> dict[str, int]:
    """Train the byte-level BPE and save it with a ChatML template; returns the special token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator([_corpus()], trainer=trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "unk_token": None, "add_bos_token": False, "model_max_length": 2048, "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }, indent=2) + "\n")
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    return {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}


def _write_generation_config(out_dir: Path, ids: dict[str, int]) -> None:
    # Chat ends on <|im_end|>, plain completion on <|endoftext|>.
    eos = [ids["eos_token_id"], ids["bos_token_id"]]
    (out_dir / "generation_config.json").write_text(json.dumps({**ids, "eos_token_id": eos}, indent=2) + "\n")


def build_hf_model(
    out_dir: Path, arch: str, seed: int = 0, config_overrides: Mapping[str, Any] | None = None
) -> Path:
    """The random source model in HF layout (bf16 safetensors, tokenizer, generation config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = write_tokenizer(out_dir)
    config = AutoConfig.for_model(arch, **(ARCH_CONFIGS[arch] | dict(config_overrides or {})), **ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=MODEL_DTYPE)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, ROUTING_BIAS_STD)
    model.save_pretrained(out_dir)
    config_file = out_dir / "config.json"
    saved = json.loads(config_file.read_text())
    renames = HUB_CONFIG_KEYS.get(arch, {})
    config_file.write_text(json.dumps({renames.get(k, k): v for k, v in saved.items()}, indent=2) + "\n")
    _write_generation_config(out_dir, ids)
    return out_dir


# Modules whose source decides what a fixture contains: their text, and the text of every module of the format
# layer they import (`fixture_sources`), is part of every cache key. Naming the encoder's module in `code` says the
# fixture was Viterbi-encoded, which also keys it by the search that ran (`viterbi_inputs`).
BUILD_CODE = ("vllm_expert_offload.testing.tiny_models", "vllm_expert_offload.exl3.convert")
ENCODE_CODE = ("vllm_expert_offload.exl3.encode",)
DECODE_CODE = ("vllm_expert_offload.exl3.decode",)
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding vllm_expert_offload/
# Where imports are followed: a build runs the format layer and the leaves, never the layers above it (the one
# exception, the compiled Viterbi of kernels/cpu_exl3.py, is keyed by its C++ sources in `viterbi_inputs`).
FOLLOWED = ("vllm_expert_offload.exl3", "vllm_expert_offload.errors", "vllm_expert_offload.units",
            "vllm_expert_offload.validation")


def _module_file(name: str) -> Path | None:
    """The source file of package module `name`, found on disk (nothing is imported); None if it is not one."""
    base = PACKAGE_ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(name: str, path: Path) -> set[str]:
    """Dotted names of the package modules `path` (module `name`) imports, in any scope, relative ones resolved;
    the packages above each one too, since importing a module runs their __init__."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(filter(None, (".".join(package[: len(package) - node.level + 1]) if node.level else "",
                                          node.module)))
            candidates = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for candidate in candidates:
            parts = candidate.split(".")
            found.update(".".join(parts[:end]) for end in range(2, len(parts) + 1))
    return {module for module in found if _module_file(module) is not None}


def fixture_sources(code: Sequence[str]) -> list[Path]:
    """The source files a fixture built by `code` (and BUILD_CODE) depends on: each module named, and every module
    under FOLLOWED that they import, directly or not, found by reading import statements, so a new helper module of
    the encoder or decoder is hashed without being listed anywhere."""
    files: dict[str, Path] = {}
    pending = [*BUILD_CODE, *code]
    while pending:
        name = pending.pop()
        if name in files:
            continue
        files[name] = _module_file(name)
        pending += [m for m in _imports(name, files[name]) if m.startswith(FOLLOWED) and m not in files]
    return [files[name] for name in sorted(files)]


def viterbi_inputs() -> dict[str, str]:
    """Which Viterbi search encodes a fixture now: the compiled one (keyed by its C++ sources) or torch's, whose
    states differ from it where fp32 rounds twice (exl3/encode.py)."""
    if compiled_viterbi() is None:
        return {"viterbi": "torch"}
    return {"viterbi": "compiled", "sources": _digest([_source_bytes(path) for path in cpu_exl3.kernel_sources()])}


def _source_bytes(path: Path) -> bytes:
    return path.read_bytes()


def _digest(parts: Sequence[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def _cache_key(spec: Mapping[str, Any], code: Sequence[str]) -> str:
    import safetensors
    import tokenizers
    import transformers

    # The tokenizer is trained on standard-library docstrings (`_corpus`): Python's version shapes it too.
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__,
                "python": platform.python_version()}
    inputs = {"spec": spec, "versions": versions} | (viterbi_inputs() if set(ENCODE_CODE) <= set(code) else {})
    sources = [_source_bytes(path) for path in fixture_sources(code)]
    return _digest([json.dumps(inputs, sort_keys=True).encode(), *sources])


def cached_fixture(
    name: str, spec: Mapping[str, Any], build: Callable[[Path], None], *, code: Sequence[str] = (),
    root: str | Path | None = None,
) -> Path:
    """`root/name-<key>`, built by `build(empty_dir)` unless present. The key hashes `spec` (JSON), library
    versions and the source of the modules in `code`, so a code change rebuilds instead of serving stale bytes.

    The build goes to a temporary sibling that is renamed into place: a directory that exists is complete,
    and concurrent test workers at worst build the same thing twice.
    """
    final = Path(root if root is not None else fixture_cache_dir()) / f"{name}-{_cache_key(spec, code)}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(work)
        os.replace(work, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def build_tiny_model(
    out_dir: str | Path | None, arch: str, *, k: float = 3, head_bits: float = 6, seed: int = 0,
    encoder: str = "random", config_overrides: Mapping[str, Any] | None = None,
    layer_bits: Mapping[int, float] | None = None,
) -> Path:
    """An EXL3 checkpoint of a random tiny `arch` model under `out_dir` (None: the fixture cache), in a
    content-keyed directory; an existing build is reused. `config_overrides` replace keys of ARCH_CONFIGS[arch].

    `layer_bits` (even empty) makes a mixed pack instead: routed experts only in EXL3, at `k` or their layer's
    K, everything else BF16 as stored (`head_bits` does not apply)."""
    if arch not in ARCH_CONFIGS:
        raise ValueError(f"arch {arch!r}: expected one of {list(ARCHITECTURES)}")
    overrides = dict(sorted((config_overrides or {}).items()))
    spec = {"arch": arch, "k": k, "head_bits": head_bits, "seed": seed, "encoder": encoder}
    spec |= {"config_overrides": overrides} if overrides else {}
    variant = "".join(f"-{key}{value}" for key, value in overrides.items())
    mixed = layer_bits is not None
    name = f"{arch}{variant}-k{k}-h{head_bits}-{encoder}-s{seed}"
    if mixed:
        spec = {**spec, "head_bits": None, "layer_bits": {str(layer): b for layer, b in sorted(layer_bits.items())}}
        name = f"{arch}{variant}-mixed-k{k}-" + "-".join(f"l{layer}k{b}" for layer, b in sorted(layer_bits.items())) \
            + f"-{encoder}-s{seed}"

    def build(work: Path) -> None:
        with tempfile.TemporaryDirectory() as source:
            build_hf_model(Path(source), arch, seed, overrides)
            convert_checkpoint(source, work, bits=k, head_bits=head_bits, codebook=Codebook.MUL1,
                               encoder=encoder, seed=seed, progress=False, routed_only=mixed, layer_bits=layer_bits)

    code = ENCODE_CODE if encoder == "viterbi" else ()
    return cached_fixture(name, spec, build, code=code, root=out_dir)


FP8_BLOCK = (128, 128)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DELEGATE = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK),
}


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 weight_scale_inv) as DeepSeek's block-FP8 checkpoints store a linear."""
    out_f, in_f = weight.shape
    rows, cols = -(-out_f // block[0]), -(-in_f // block[1])
    w = torch.nn.functional.pad(weight.float(), (0, cols * block[1] - in_f, 0, rows * block[0] - out_f))
    tiles = w.reshape(rows, block[0], cols, block[1])
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (tiles / scale[:, None, :, None]).reshape(rows * block[0], cols * block[1])[:out_f, :in_f]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def _write_fp8_mixed(mixed_dir: Path, work: Path) -> None:
    """The mixed pack in `mixed_dir` with every non-routed linear but lm_head in block FP8, delegated to vLLM's
    `fp8` (DeepSeek's published layout: `non_routed_quantization` and no dtype policy)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(mixed_dir, work, dirs_exist_ok=True)
    tensors = load_file(work / "model.safetensors")
    for name in list(tensors):
        prefix, suffix = split_name(name)
        if suffix == "weight" and prefix != HEAD and prefix.rpartition(".")[2] in LINEAR_LEAVES:
            tensors[name], tensors[f"{prefix}.{BLOCK_FP8_SCALE}"] = quantize_block_fp8(tensors[name])
    save_file(tensors, work / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((work / "config.json").read_text())
    quant = config["quantization_config"]
    quant.pop("non_routed_dtype_policy")
    quant["non_routed_quantization"] = FP8_DELEGATE
    (work / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_fp8_mixed_model(arch: str, *, k: float = 3, layer_bits: Mapping[int, float] | None = None) -> Path:
    """A tiny mixed pack whose non-routed linears are block FP8 (the DeepSeek packs' layout), cached."""
    mixed = build_tiny_model(None, arch, k=k, layer_bits=layer_bits or {})
    spec = {"fp8_of": mixed.name, "block": FP8_BLOCK}
    return cached_fixture(f"{mixed.name}-fp8", spec, lambda work: _write_fp8_mixed(mixed, work))


def build_dense_twin(
    exl3_dir: str | Path, out_dir: str | Path | None = None, dtype: torch.dtype = torch.float32
) -> Path:
    """The dequantized HF twin of `exl3_dir`: written to `out_dir`, or without one cached under a key that
    includes the EXL3 checkpoint's bytes (tiny fixtures hash in milliseconds)."""
    exl3_dir = Path(exl3_dir)
    if out_dir is not None:
        return write_dense_twin(exl3_dir, out_dir, dtype)
    files = [exl3_dir / "config.json", *sorted(exl3_dir.glob("*.safetensors"))]
    dtype_name = str(dtype).removeprefix("torch.")
    spec = {"twin": dtype_name, "checkpoint": _digest([f.read_bytes() for f in files if f.is_file()])}
    return cached_fixture(
        f"{exl3_dir.name}-twin-{dtype_name}", spec, lambda work: write_dense_twin(exl3_dir, work, dtype),
        code=DECODE_CODE,
    )
