"""`bench`: per-stream decode speed, TTFT and aggregate throughput of a running OpenAI-compatible server.

Answers "how many agent sessions can this server carry at a target tok/s each": for each concurrency it runs that
many agent-like sessions at once (a long shared system prefix plus per-turn text, streamed) after a warm-up, and
measures a long prefix's TTFT cold and from the prefix cache. Works against any server that streams completions
and lets a client count each chunk's tokens (vLLM's continuous_usage_stats, or logprobs); a server offering neither
is refused, since speeds built on guessed counts can be impossible. Each level reports the decode rate beside the
end-to-end rate and the chunks that carried several tokens, and is checked against the server's own generated-token
counter (vLLM's /metrics): a level that fails is flagged and carries no capacity. The server version is read from
vLLM's `/version` when there is one.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
from pathlib import Path

import aiohttp
import httpx
from tqdm import tqdm

from .serving_load import AgentLoad, LevelResult


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="per-stream tok/s, TTFT and aggregate tok/s of a running server at several concurrencies",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000 (/v1 optional)")
    parser.add_argument("--model", help="served model name (default: the server's first model)")
    parser.add_argument("--concurrency", default="1,4,6", help="comma-separated stream counts (default 1,4,6)")
    parser.add_argument("--output-tokens", type=int, default=256, help="tokens generated per request (default 256)")
    parser.add_argument("--prefix-tokens", type=int, default=4096, help="shared system prefix length (default 4096)")
    parser.add_argument("--turns", type=int, default=2, help="sequential requests per session (default 2)")
    parser.add_argument("--cold-prefix-tokens", type=int,
                        help="length of the cold-vs-cached TTFT prompt (default: --prefix-tokens)")
    parser.add_argument("--ttft-repeats", type=int, default=3, help="cold/cached pairs, median taken (default 3)")
    parser.add_argument("--target-tok-s", type=float, default=40.0, help="per-stream target for the plot (default 40)")
    parser.add_argument("--json", required=True, type=Path, help="results file")
    parser.add_argument("--plot", type=Path, help="PNG of per-stream tok/s against concurrency (needs matplotlib)")
    parser.set_defaults(handler=run)


def capacity(levels: list[LevelResult], target_tok_s: float) -> int | None:
    """The largest measured concurrency whose median per-stream speed still meets the target.

    Levels that failed (see LevelResult.failed) are no result and so carry no capacity."""
    meeting = [level.concurrency for level in levels
               if level.failed is None and level.median_tok_s is not None and level.median_tok_s >= target_tok_s]
    return max(meeting) if meeting else None


async def _server_facts(http: httpx.AsyncClient, model: str | None) -> tuple[str, str | None]:
    response = await http.get("/version")
    version = response.json().get("version") if response.status_code == 200 else None
    return model or (await http.get("/v1/models")).raise_for_status().json()["data"][0]["id"], version


async def _measure(args: argparse.Namespace, concurrency: list[int]) -> dict:
    base = args.url.rstrip("/").removesuffix("/v1")
    async with (httpx.AsyncClient(base_url=base, timeout=600) as http,
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session):
        model, version = await _server_facts(http, args.model)
        total = 2 + args.turns * sum(concurrency) + 2 * args.ttft_repeats
        with tqdm(total=total, desc="requests", unit="req") as bar:
            load = AgentLoad(session, base, model, args.prefix_tokens, args.output_tokens, on_request=bar.update)
            await load.warm_up()
            levels = [await load.level(c, args.turns) for c in concurrency]
            cold_tokens = args.cold_prefix_tokens or args.prefix_tokens
            cold, cached, cold_prompt_tokens = await load.cold_and_cached_ttft(cold_tokens, args.ttft_repeats)
    settings = {
        "url": base, "model": model, "server_version": version, "prefix_tokens": args.prefix_tokens,
        "prompt_tokens_mean": [level.mean_prompt_tokens for level in levels], "output_tokens": args.output_tokens,
        "turns": args.turns, "token_counting": load.counting, "cold_prompt_tokens": cold_prompt_tokens,
        "ttft_repeats": args.ttft_repeats,
        "target_tok_s": args.target_tok_s, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    return {"concurrency": [level_row(level) for level in levels], "ttft_cold_s": cold, "ttft_cached_s": cached,
            "capacity_at_target": capacity(levels, args.target_tok_s), "settings": settings}


def level_row(level: LevelResult) -> dict:
    """A level as the JSON holds it and `level_line` prints it: its figures, its server check, why it failed."""
    return {k: v for k, v in dataclasses.asdict(level).items() if k != "mean_prompt_tokens"} | {"failed": level.failed}


def plot(result: dict, path: Path) -> None:
    """Per-stream median (and p5) tok/s against concurrency, with the target line and the capacity it implies.

    Failed levels are left out: their speeds are not results."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib: pip install 'vllm-expert-offload[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, target = [r for r in result["concurrency"] if r["failed"] is None], result["settings"]["target_tok_s"]
    streams = [row["concurrency"] for row in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(streams, [row["median_tok_s"] for row in rows], "o-", label="per-stream decode median")
    ax.plot(streams, [row["p5_tok_s"] for row in rows], "v--", label="per-stream decode p5")
    ax.plot(streams, [row["median_end_to_end_tok_s"] for row in rows], "s-.", label="per-stream end-to-end median")
    ax.axhline(target, color="red", linestyle=":", label=f"target {target:g} tok/s")
    if (cap := result["capacity_at_target"]) is not None:
        ax.axvline(cap, color="gray", linestyle=":", label=f"capacity: {cap} streams")
    ax.set(xlabel="concurrent streams", ylabel="decode tok/s per stream", xticks=streams, ylim=(0, None),
           title=f"{result['settings']['model']} ({result['settings']['server_version'] or 'server'})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def level_line(row: dict) -> str:
    """One level as a user reads it; a failed level says why instead of printing its speeds as a result."""
    head = f"{row['concurrency']:3d} streams: "
    burst = (f"; {row['merged_chunks']} of {row['chunks']} chunks carried several tokens (the server fell behind "
             "its engine)" if row["merged_chunks"] else "")
    if row["failed"] is not None:
        return f"{head}FAILED, not a result: {row['failed']}{burst}"
    check = row["server_check"]
    checked = (f", server generated {check['server_tok_s']:.1f} tok/s" if check is not None
               else ", not checked: the server exposes no vllm:generation_tokens_total")
    return (f"{head}decode {row['median_tok_s']:8.1f} tok/s per stream (p5 {row['p5_tok_s']:.1f}), end-to-end "
            f"{row['median_end_to_end_tok_s']:.1f} (p5 {row['p5_end_to_end_tok_s']:.1f}), TTFT "
            f"{row['ttft_median_s']:.3f} s (p95 {row['ttft_p95_s']:.3f}), {row['aggregate_tok_s']:.1f} tok/s total"
            f"{checked}{burst}")


def run(args: argparse.Namespace) -> int:
    concurrency = [int(c) for c in args.concurrency.split(",")]
    result = asyncio.run(_measure(args, concurrency))
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    for row in result["concurrency"]:
        print(level_line(row))
    print(f"TTFT of a {result['settings']['cold_prompt_tokens']}-token prompt: cold {result['ttft_cold_s']:.3f} s, "
          f"cached {result['ttft_cached_s']:.3f} s; capacity at {args.target_tok_s:g} tok/s: "
          f"{result['capacity_at_target']} streams")
    if args.plot:
        plot(result, args.plot)
    return 0
