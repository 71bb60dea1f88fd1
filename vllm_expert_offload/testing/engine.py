"""Greedy generation on the real vLLM engine, in a child process.

Each engine start binds OpenMP threads, sets up torch.distributed and leaves global state behind,
so tests run every engine in a fresh interpreter and read the tokens back as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ENGINE_TIMEOUT_S = 600
LOG_TAIL_CHARS = 6000


class EngineFailed(RuntimeError):
    """The engine child exited without a result. The message carries the log's tail, enough to read a failure;
    `log` keeps all of it, so a test can check what happened (or did not) anywhere in the run."""

    def __init__(self, returncode: int, log: str) -> None:
        super().__init__(f"engine failed (exit {returncode}):\n{log[-LOG_TAIL_CHARS:]}")
        self.log = log


@dataclass
class EngineSpec:
    model: str
    prompts: list[list[int]]
    max_tokens: int = 24
    block_size: int = 128
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # vLLM's --enable-expert-parallel: whole experts over the TP ranks
    dtype: str = "float32"
    max_model_len: int = 1024
    additional_config: dict | None = None
    enforce_eager: bool = False  # vLLM's default: torch.compile (and CUDA graphs on a GPU); True: eager mode
    # vLLM's default when None. It bounds the readiness smoke (one full scheduler step of prompt) and, under
    # Inductor, the CPU runner's warm-up forward: under Triton's interpreter a small budget keeps both short.
    max_num_batched_tokens: int | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    rpc_after: list[tuple[str, list]] = field(default_factory=list)  # collective_rpc calls after generating
    # Modules whose install() runs in the engine child before vLLM is imported (test-only shims, e.g.
    # vllm_expert_offload.testing.dsv4_cpu_shim); the plugin's register() never installs them.
    preload: list[str] = field(default_factory=list)


def engine_env(tensor_parallel_size: int) -> dict[str, str]:
    """The CPU test-stack settings (docs/development.md): small KV cache, in-process engine core at TP 1,
    one OpenMP thread per rank at TP 2 so two ranks fit on two cores."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    if tensor_parallel_size == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tensor_parallel_size))
    return env


def generate_greedy(spec: EngineSpec) -> list[list[int]]:
    """Token ids generated for each prompt; raises with the child's log tail if the engine fails."""
    return generate_timed(spec)[0]


def generate_timed(spec: EngineSpec) -> tuple[list[list[int]], float]:
    """Token ids per prompt and the seconds `LLM.generate` took (engine start excluded); EngineFailed if none."""
    result = generate_report(spec)
    return result["tokens"], result["generate_s"]


def generate_report(spec: EngineSpec) -> dict:
    """The child's whole result: `tokens`, `generate_s`, `rpc` (each rpc_after call's per-rank returns) and `log`
    (everything the engine and its workers printed)."""
    env = {**os.environ, **engine_env(spec.tensor_parallel_size), **spec.extra_env}
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_expert_offload.testing.engine"],
        input=json.dumps(asdict(spec)), capture_output=True, text=True, env=env, timeout=ENGINE_TIMEOUT_S,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]) | {"log": proc.stdout + proc.stderr}
    raise EngineFailed(proc.returncode, proc.stdout + proc.stderr)


def _run(spec: EngineSpec) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {"additional_config": spec.additional_config} if spec.additional_config else {}
    if spec.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = spec.max_num_batched_tokens
    llm = LLM(
        spec.model, dtype=spec.dtype, max_model_len=spec.max_model_len, enforce_eager=spec.enforce_eager,
        block_size=spec.block_size, tensor_parallel_size=spec.tensor_parallel_size,
        enable_expert_parallel=spec.enable_expert_parallel, seed=0, **kwargs,
    )
    params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec.prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    rpc = [llm.collective_rpc(method, args=tuple(args)) for method, args in spec.rpc_after]
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "generate_s": elapsed, "rpc": rpc}


def _preload(modules: list[str]) -> None:
    import importlib

    for name in modules:
        importlib.import_module(name).install()


if __name__ == "__main__":
    spec = EngineSpec(**json.loads(sys.stdin.read()))
    Path(spec.model)  # fail early on a bad spec
    _preload(spec.preload)
    print("RESULT " + json.dumps(_run(spec)), flush=True)
