"""The guides and examples say only what the tools accept: every `vllm-expert-offload` and `vllm serve` command
in a ```bash block of README.md and docs/, and in examples/*.sh, parses with the real argument parsers (ours and
vLLM's), its `--additional-config expert_offload` keys are known, and the example plan is a plan the loader takes
for the model it was made for."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from support.paths import REPO

ROOT = REPO
# Shell variables of examples/serve_two_gpus.sh and placeholders of the guides, with values of the right type.
VALUES = {"MODEL": "/models/M", "GPU_BUDGET_GIB": "60", "KV_CACHE_GIB": "20", "GPU_MEMORY_GIB": "95", "TOP_K": "8",
          "PLAN": "plan.json", "PORT": "8000", "RECORD": "/tmp/stats.json", "STATS": "stats.json",
          "offload": '{"expert_offload": {"plan": "plan.json"}}', "stats_args[@]": "--stats stats.json"}


def _shell_lines(text: str) -> list[str]:
    """Logical lines (continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines()]


def _bash_blocks(markdown: str) -> str:
    return "\n".join(re.findall(r"```bash\n(.*?)```", markdown, flags=re.DOTALL))


def _commands() -> list[tuple[str, list[str]]]:
    sources = {path: _bash_blocks(path.read_text()) for path in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]}
    sources |= {path: path.read_text() for path in sorted(ROOT.glob("examples/*.sh"))}
    found = []
    for path, text in sources.items():
        for line in _shell_lines(text):
            line = re.sub(r"^exec\s+", "", line).rstrip("&").strip()
            if not line.startswith(("vllm-expert-offload ", "vllm serve ")) or "$(python" in line:
                continue
            line = re.sub(r'"?\$\{?([A-Za-z_]+(?:\[@\])?)\}?"?', lambda m: shlex.quote(VALUES[m.group(1)])
                          if m.group(1) != "stats_args[@]" else VALUES[m.group(1)], line)
            found.append((f"{path.relative_to(ROOT)}: {line[:60]}", shlex.split(line)))
    return found


COMMANDS = _commands()


def test_the_guides_have_commands_to_check() -> None:
    files = {name.split(":")[0] for name, _ in COMMANDS}
    assert {"docs/serving-two-gpus.md", "examples/serve_two_gpus.sh", "docs/memory.md"} <= files
    assert sum(argv[:2] == ["vllm", "serve"] for _, argv in COMMANDS) >= 5


@pytest.mark.parametrize("argv", [argv for _, argv in COMMANDS if argv[0] == "vllm-expert-offload"],
                         ids=[name for name, argv in COMMANDS if argv[0] == "vllm-expert-offload"])
def test_our_commands_parse(argv: list[str]) -> None:
    from vllm_expert_offload.cli import build_parser

    args = build_parser().parse_args(argv[1:])  # SystemExit (a failure) on any unknown or malformed option
    assert callable(args.handler)


@pytest.fixture(scope="module")
def vllm_serve_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def test_vllm_serve_commands_parse_and_name_known_options(vllm_serve_parser) -> None:
    from vllm_expert_offload.offload.options import _KNOWN, _PLACEMENT_KEYS, OPTION_KEY

    serve = [(name, argv) for name, argv in COMMANDS if argv[:2] == ["vllm", "serve"]]
    for name, argv in serve:
        args = vllm_serve_parser.parse_args(argv[2:])
        offload = (args.additional_config or {}).get(OPTION_KEY)
        if offload is not None:
            assert set(offload) <= _KNOWN, (name, sorted(set(offload) - _KNOWN))
            assert sum(key in offload for key in _PLACEMENT_KEYS) == 1, name
    with pytest.raises(SystemExit):  # the check can fail: an option vLLM lacks is refused
        vllm_serve_parser.parse_args(["/models/M", "--no-such-option", "1"])


def test_example_plan_loads_for_the_model_it_was_made_for() -> None:
    from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
    from vllm_expert_offload.placement import RoutingCounts, load_plan
    from vllm_expert_offload.testing.tiny_models import build_tiny_model
    from vllm_expert_offload.tools.plan_cmd import expert_sizes

    directory = ROOT / "examples" / "plan"
    _, sizes, identity = expert_sizes(Exl3Checkpoint.open(build_tiny_model(None, "qwen3_moe")), 2)
    plan = load_plan(directory / "plan.json", identity)
    counts = RoutingCounts.load(directory / "stats.json", identity).counts
    doc = json.loads((directory / "plan.json").read_text())
    assert plan.sum() * sizes.max() <= doc["budget_bytes"] and (sizes == sizes.max()).all()
    # The README's claim: the budget went to the most selected experts over both layers.
    assert counts[plan].min() >= counts[~plan].max()
    readme = (directory / "README.md").read_text()
    for field in [*(key for key in doc if key != "model"), *(f"model.{key}" for key in doc["model"])]:
        assert f"`{field}`" in readme, field
