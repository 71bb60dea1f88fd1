"""`--additional-config expert_offload` options and the crash line: bad values refused with the key named."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from vllm_expert_offload.integration.startup.crash_line import CrashLineError, check_crash_line
from vllm_expert_offload.offload.options import OffloadOptionError, parse_offload_options

GIB = 1 << 30


def test_absent_entry_changes_nothing() -> None:
    assert not parse_offload_options(None).offloads
    assert not parse_offload_options({"other_plugin": {}}).offloads


def test_valid_options(tmp_path) -> None:
    stats = tmp_path / "stats.json"
    stats.write_text("{}")
    opts = parse_offload_options({"expert_offload": {"gpu_budget_gib": 12.5, "stats": str(stats)}})
    assert opts.offloads and opts.gpu_budget_gib == 12.5 and opts.stats == stats and opts.min_free_fraction == 0.03
    assert parse_offload_options({"expert_offload": {"host_fraction": 1}}).host_fraction == 1.0


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"host_fraction": 1.5}, "expert_offload.host_fraction"),
        ({"host_fraction": "half"}, "expert_offload.host_fraction"),
        ({"host_fraction": True}, "expert_offload.host_fraction"),
        ({"gpu_budget_gib": -1}, "expert_offload.gpu_budget_gib"),
        ({"gpu_budget_gib": float("nan")}, "expert_offload.gpu_budget_gib"),
        ({"gpu_budget_gib": float("inf")}, "expert_offload.gpu_budget_gib"),
        ({"gpu_budget_gib": 10**300}, "expert_offload.gpu_budget_gib: 1000000000000"),  # a float, far out of range
        ({"gpu_budget_gib": 10**400}, "expert_offload.gpu_budget_gib: an integer of 1329 bits is too large"),
        ({"host_fraction": 10**400}, "expert_offload.host_fraction: an integer of 1329 bits"),
        ({"plan": "/nonexistent/plan.json"}, "expert_offload.plan"),
        ({"host_fracton": 0.5}, "expert_offload.host_fracton"),
        ({"host_fraction": 0.5, "gpu_budget_gib": 4}, "give one of"),
        ({"host_fraction": 0.5, "stats": "/tmp"}, "expert_offload.stats"),
        ({"min_free_fraction": 0.9}, "expert_offload.min_free_fraction"),
        ({"record_stats": ""}, "expert_offload.record_stats"),
        ({"kernel": "cuda"}, "expert_offload.kernel"),
        ({"dequantize_linears": "yes"}, "expert_offload.dequantize_linears"),
    ],
)
def test_bad_values_refused_with_key_named(raw: dict, named: str) -> None:
    with pytest.raises(OffloadOptionError, match=named.replace(".", r"\.")):
        parse_offload_options({"expert_offload": raw})


def test_not_an_object_refused() -> None:
    with pytest.raises(OffloadOptionError, match="expected an object"):
        parse_offload_options({"expert_offload": 0.5})


def test_crash_line_passes_with_margin() -> None:
    check_crash_line(free_bytes=5 * GIB, total_bytes=100 * GIB, min_free_fraction=0.03,
                     gpu_memory_utilization=0.95, gpu_expert_sizes=[GIB] * 4)


def test_crash_line_refuses_with_both_remedies() -> None:
    # 1 GiB free of 100 GiB with a 3% line: 2 GiB short.
    with pytest.raises(CrashLineError) as err:
        check_crash_line(free_bytes=1 * GIB, total_bytes=100 * GIB, min_free_fraction=0.03,
                         gpu_memory_utilization=0.95, gpu_expert_sizes=[GIB // 2] * 10)
    message = str(err.value)
    assert "1.00 GiB of 100.00 GiB" in message and "3% crash line (3.00 GiB)" in message
    assert "--gpu-memory-utilization to 0.930" in message
    assert "at least 4 more experts to the host tier" in message


def test_crash_line_counts_the_activation_headroom_as_taken() -> None:
    """5 GiB free right after the KV cache passes a 3 % line, unless vLLM's activation peak will take 4 of them."""
    args = dict(free_bytes=5 * GIB, total_bytes=100 * GIB, min_free_fraction=0.03, gpu_memory_utilization=0.95,
                gpu_expert_sizes=[GIB] * 4)
    check_crash_line(**args, activation_headroom=2 * GIB)
    with pytest.raises(CrashLineError) as err:
        check_crash_line(**args, activation_headroom=4 * GIB)
    assert "4.00 GiB is vLLM's activation headroom, leaving 1.00 GiB" in str(err.value)
    assert "--gpu-memory-utilization to 0.930" in str(err.value)


def test_crash_line_advice_follows_an_explicit_kv_cache_size() -> None:
    with pytest.raises(CrashLineError, match=f"--kv-cache-memory-bytes to {20 * GIB - 2 * GIB} or less"):
        check_crash_line(free_bytes=1 * GIB, total_bytes=100 * GIB, min_free_fraction=0.03,
                         gpu_memory_utilization=0.9, gpu_expert_sizes=[GIB], kv_cache_memory_bytes=20 * GIB)


def test_crash_line_when_experts_cannot_cover_it() -> None:
    with pytest.raises(CrashLineError, match="would not free enough"):
        check_crash_line(free_bytes=0, total_bytes=100 * GIB, min_free_fraction=0.03,
                         gpu_memory_utilization=0.9, gpu_expert_sizes=[GIB])


def test_kernel_options_parsed() -> None:
    assert parse_offload_options(None).kernel == "auto"
    opts = parse_offload_options({"expert_offload": {"kernel": "triton", "dequantize_linears": True}})
    assert (opts.kernel, opts.dequantize_linears) == ("triton", True)
    assert not opts.offloads  # choosing a kernel places nothing


def test_record_stats_interval(tmp_path) -> None:
    path = str(tmp_path / "stats.json")
    assert parse_offload_options({"expert_offload": {"record_stats": path}}).record_stats_interval_s == 300.0
    opts = parse_offload_options({"expert_offload": {"record_stats": path, "record_stats_interval_s": 2.5}})
    assert (opts.record_stats, opts.record_stats_interval_s) == (tmp_path / "stats.json", 2.5)
    assert parse_offload_options({"expert_offload": {"record_stats": path, "record_stats_interval_s": 1}}
                                 ).record_stats_interval_s == 1.0
    for bad in (0, -5, "300", float("inf"), 1e-300, 0.999, 10**400):
        with pytest.raises(OffloadOptionError, match=r"--additional-config expert_offload\.record_stats_interval_s"):
            parse_offload_options({"expert_offload": {"record_stats": path, "record_stats_interval_s": bad}})
    with pytest.raises(OffloadOptionError, match=r"record_stats_interval_s: only used together with record_stats"):
        parse_offload_options({"expert_offload": {"record_stats_interval_s": 60}})


def test_record_stats_path_that_cannot_be_written_is_refused_with_the_path_named(tmp_path) -> None:
    missing = tmp_path / "no-such-dir" / "stats.json"
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    blocked.chmod(0o500)
    # root writes anywhere permissions say it may not; /proc/self takes no new files from anyone
    unwritable = (Path("/proc/self") if os.geteuid() == 0 else blocked) / "stats.json"
    cases = [(missing, "does not exist"), (tmp_path, "is a directory"), (unwritable, "is not writable")]
    for path, reason in cases:
        with pytest.raises(OffloadOptionError) as err:
            parse_offload_options({"expert_offload": {"record_stats": str(path)}})
        message = str(err.value)
        assert message.startswith("--additional-config expert_offload.record_stats:") and str(path) in message
        assert reason in message


def test_record_stats_target_that_is_not_a_regular_file_is_refused_untouched(tmp_path, monkeypatch) -> None:
    """A save renames a new file over the path, so whatever is there is replaced: refused at startup, by lstat
    alone (a FIFO opened for reading would block startup; nothing at the path is opened)."""
    regular = tmp_path / "stats.json"
    regular.write_text("{}")
    fifo, link, dangling = tmp_path / "fifo", tmp_path / "link.json", tmp_path / "dangling.json"
    os.mkfifo(fifo)
    link.symlink_to(regular)
    dangling.symlink_to(tmp_path / "nowhere.json")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "sock"))
    server.close()
    cases = [(fifo, "a FIFO"), (link, "a symbolic link"), (dangling, "a symbolic link"),
             (tmp_path / "sock", "a socket"), (Path("/dev/null"), "a character device")]
    before = {path: os.lstat(path) for path, _ in cases}
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k))
    for path, what in cases:
        with pytest.raises(OffloadOptionError) as err:
            parse_offload_options({"expert_offload": {"record_stats": str(path)}})
        assert str(err.value) == (f"--additional-config expert_offload.record_stats: {path} is {what}; expected a "
                                  "regular file or a new file's path")
        assert os.lstat(path) == before[path]
    assert not [name for name in opened if Path(name) in before]
    assert parse_offload_options({"expert_offload": {"record_stats": str(regular)}}).record_stats == regular


def test_dynamic_option_parsed_once_off_unless_asked() -> None:
    assert parse_offload_options({"expert_offload": {"host_fraction": 0.5}}).dynamic is None
    opts = parse_offload_options({"expert_offload": {"host_fraction": 0.5, "dynamic": {}}})
    assert opts.caches and opts.dynamic.policy == "decayed-lfu"  # the default policy when on
    lru = parse_offload_options({"expert_offload": {"host_fraction": 0.5,
                                                    "dynamic": {"policy": "lru", "half_life_tokens": 16}}})
    assert lru.dynamic.policy == "lru" and lru.dynamic.half_life_tokens == 16
    off = parse_offload_options({"expert_offload": {"host_fraction": 0.5, "dynamic": {"policy": "off"}}})
    assert off.dynamic is not None and not off.caches


@pytest.mark.parametrize(
    ("dynamic", "named"),
    [
        ({"policy": "lfu"}, "expert_offload.dynamic.policy: 'lfu' is not one of"),
        ({"half_life_tokens": 0}, "expert_offload.dynamic.half_life_tokens"),
        ({"half_life_tokens": "8"}, "expert_offload.dynamic.half_life_tokens"),
        ({"policy": "lru", "halflife": 3}, "expert_offload.dynamic.halflife: unknown option"),
        ("lru", "expert_offload.dynamic: expected an object"),
    ],
)
def test_bad_dynamic_values_refused_with_key_named(dynamic, named: str) -> None:
    with pytest.raises(OffloadOptionError, match=named.replace(".", r"\.").replace("(", r"\(")):
        parse_offload_options({"expert_offload": {"host_fraction": 0.5, "dynamic": dynamic}})


def test_dynamic_without_a_host_tier_refused() -> None:
    with pytest.raises(OffloadOptionError, match=r"expert_offload\.dynamic: only used together with"):
        parse_offload_options({"expert_offload": {"dynamic": {"policy": "lru"}}})


def test_cpu_tier_parsed_once_off_unless_asked() -> None:
    assert parse_offload_options({"expert_offload": {"host_fraction": 0.5}}).cpu_tier is None
    auto = parse_offload_options({"expert_offload": {"host_fraction": 0.5, "cpu_tier": {}}}).cpu_tier
    assert (auto.threads, auto.cpus, auto.max_tokens, auto.split) == (None, None, 64, "auto")
    given = parse_offload_options({"expert_offload": {"host_fraction": 0.5, "cpu_tier": {
        "threads": 3, "cpus": "7,2-3", "max_tokens": 5, "split": "all"}}}).cpu_tier
    assert (given.threads, given.cpus, given.max_tokens, given.split) == (3, (2, 3, 7), 5, "all")
    assert parse_offload_options({"expert_offload": {"plan": __file__, "cpu_tier": {"threads": "auto"}}}).cpu_tier


def test_cpu_tier_cpu_list_boundaries_are_accepted() -> None:
    """A range of one CPU ("5-5") and as many threads as CPUs: the edges of what the refusals below refuse."""
    tier = parse_offload_options({"expert_offload": {"host_fraction": 0.5, "cpu_tier": {
        "cpus": "5-5,0", "threads": 2}}}).cpu_tier
    assert (tier.cpus, tier.threads) == ((0, 5), 2)


@pytest.mark.parametrize(
    ("cpu_tier", "named"),
    [
        ({"threads": 0}, "cpu_tier.threads: expected \"auto\" or an integer >= 1, got 0"),
        ({"threads": 2.0}, "cpu_tier.threads: expected"),
        ({"threads": True}, "cpu_tier.threads: expected"),
        ({"threads": "all"}, "cpu_tier.threads: expected"),
        ({"cpus": ""}, "cpu_tier.cpus: expected"),
        ({"cpus": "3-1"}, "cpu_tier.cpus: expected"),
        ({"cpus": "0,3-1"}, "cpu_tier.cpus: expected"),
        ({"cpus": "1,1"}, "cpu_tier.cpus: expected"),
        ({"cpus": "-1"}, "cpu_tier.cpus: expected"),
        ({"cpus": "a-b"}, "cpu_tier.cpus: expected"),
        ({"cpus": [1, 2]}, "cpu_tier.cpus: expected"),
        ({"cpus": "0-1", "threads": 3}, "cpu_tier.threads: 3 threads on the 2 CPUs"),
        ({"max_tokens": 0}, "cpu_tier.max_tokens: expected an integer >= 1"),
        ({"max_tokens": 1.5}, "cpu_tier.max_tokens: expected an integer >= 1"),
        ({"split": "half"}, "cpu_tier.split: 'half' is not one of"),
        ({"thread": 2}, "cpu_tier.thread: unknown option"),
        ("auto", "cpu_tier: expected an object"),
    ],
)
def test_bad_cpu_tier_values_refused_with_key_named(cpu_tier, named: str) -> None:
    with pytest.raises(OffloadOptionError, match="expert_offload." + named.replace(".", r"\.")):
        parse_offload_options({"expert_offload": {"host_fraction": 0.5, "cpu_tier": cpu_tier}})


def test_cpu_tier_without_a_host_tier_refused() -> None:
    with pytest.raises(OffloadOptionError, match=r"expert_offload\.cpu_tier: only used together with"):
        parse_offload_options({"expert_offload": {"cpu_tier": {}}})


def test_options_are_parsed_once_per_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API process's check and the first layer's read, in one process, parse once (the record_stats write
    probe runs once); equal objects share the result, another object is parsed, a refusal is raised each time."""
    from vllm_expert_offload.offload import options

    calls = []
    monkeypatch.setattr(options, "_PARSED", {})
    monkeypatch.setattr(options, "_parse", lambda raw, parse=options._parse: calls.append(raw) or parse(raw))
    config = {"expert_offload": {"host_fraction": 0.25, "record_stats": str(tmp_path / "stats.json")}}
    first = parse_offload_options(config)
    assert parse_offload_options(json.loads(json.dumps(config))) is first and len(calls) == 1
    assert parse_offload_options({"expert_offload": {"host_fraction": 0.5}}).host_fraction == 0.5 and len(calls) == 2
    for _ in range(2):
        with pytest.raises(OffloadOptionError, match="host_fraction"):
            parse_offload_options({"expert_offload": {"host_fraction": 2}})
    assert len(calls) == 4
