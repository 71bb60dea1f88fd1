"""Issue #40 item 3: every bad input a user can give the CLI exits 2 with one `error:` line naming what is wrong,
checked by the same readers serving uses; `--debug` shows the traceback instead."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vllm_expert_offload.cli import main
from vllm_expert_offload.exl3.errors import Exl3FormatError
from vllm_expert_offload.offload.options import OffloadOptionError, parse_offload_options
from vllm_expert_offload.testing.tiny_models import build_tiny_model
from vllm_expert_offload.tools.errors import ToolInputError

SHARD = "model.safetensors"


@pytest.fixture(scope="module")
def tiny() -> Path:
    return build_tiny_model(None, "qwen3_moe")


@pytest.fixture
def truncated(tmp_path: Path, tiny: Path) -> Path:
    """The tiny checkpoint with its shard cut in half: headers intact, half the data missing."""
    out = tmp_path / "truncated"
    shutil.copytree(tiny, out)
    data = (out / SHARD).read_bytes()
    (out / SHARD).write_bytes(data[: len(data) // 2])
    return out


def _one_line_refusal(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


@pytest.mark.parametrize("flags, key, value", [
    (["--host-fraction", "1.5"], "host_fraction", 1.5),
    (["--host-fraction", "-0.5"], "host_fraction", -0.5),
    (["--host-fraction", "nan"], "host_fraction", float("nan")),
    (["--gpu-budget-gib", "-1"], "gpu_budget_gib", -1.0),
    (["--gpu-budget-gib", "inf"], "gpu_budget_gib", float("inf")),
    (["--gpu-budget-gib", "1", "--margin", "0.6"], "min_free_fraction", 0.6),
])
def test_plan_refuses_what_serving_refuses_with_its_message(tmp_path, capsys, tiny, flags, key, value) -> None:
    """The same reader as `vllm serve --additional-config`: its message follows the flag, and no plan is written."""
    out = tmp_path / "p.json"
    line = _one_line_refusal(capsys, ["plan", "--model", str(tiny), *flags, "--out", str(out)])
    raw = {"gpu_budget_gib": 1.0, key: value} if key == "min_free_fraction" else {key: value}
    with pytest.raises(OffloadOptionError) as serving:
        parse_offload_options({"expert_offload": raw})
    assert line.endswith(str(serving.value)), (line, str(serving.value))
    assert line.startswith(f"error: {flags[-2]}: "), line
    assert not out.exists()


def test_plan_refuses_stats_without_a_budget(tmp_path, capsys, tiny) -> None:
    stats = tmp_path / "stats.json"
    stats.write_text("{}")
    line = _one_line_refusal(capsys, ["plan", "--model", str(tiny), "--host-fraction", "0.5", "--stats", str(stats),
                                      "--out", str(tmp_path / "p.json")])
    assert line.startswith("error: --stats: ") and "only used together with gpu_budget_gib" in line


@pytest.mark.parametrize("flags, expect", [
    (["--tp", "0"], "error: --tp: 0 ranks; expected at least 1"),
    (["--dp", "-2"], "error: --dp: -2 ranks; expected at least 1"),
    (["--kv-cache-gib", "-1"], "error: --kv-cache-gib: -1.0 is outside [0, inf]"),
    (["--gpu-memory-gib", "nan"], "error: --gpu-memory-gib: nan is not a finite number"),
    (["--tp", "3"], "error: --tp 3 does not divide the expert intermediate size"),
])
def test_plan_refuses_bad_layout_flags(tmp_path, capsys, tiny, flags, expect) -> None:
    line = _one_line_refusal(capsys, ["plan", "--model", str(tiny), "--host-fraction", "0.5", *flags,
                                      "--out", str(tmp_path / "p.json")])
    assert line.startswith(expect), line


def test_plan_edge_fractions_accepted(tmp_path, capsys, tiny) -> None:
    """Positive controls at the range's ends: all experts on host, none on host."""
    for fraction, host in (("1", "8 of 8"), ("0", "0 of 8")):
        assert main(["plan", "--model", str(tiny), "--host-fraction", fraction, "--out", str(tmp_path / "p.json")]) == 0
        assert f"the last {host.split()[0]} experts of each layer" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["plan", "inspect"])
def test_truncated_shard_refused_by_name_as_serving_refuses_it(tmp_path, capsys, truncated, command) -> None:
    from vllm_expert_offload.integration.methods.quant_config import scan_checkpoint

    argv = (["plan", "--model", str(truncated), "--host-fraction", "0.5", "--out", str(tmp_path / "p.json")]
            if command == "plan" else ["inspect", str(truncated)])
    line = _one_line_refusal(capsys, argv)
    with pytest.raises(Exl3FormatError) as serving:
        scan_checkpoint(str(truncated))
    assert line == f"error: {serving.value}" and SHARD in line and "truncated" in line, line


def test_debug_shows_the_traceback(tmp_path, tiny) -> None:
    with pytest.raises(ToolInputError, match="--host-fraction"):
        main(["--debug", "plan", "--model", str(tiny), "--host-fraction", "1.5", "--out", str(tmp_path / "p.json")])
