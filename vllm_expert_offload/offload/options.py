"""`--additional-config '{"expert_offload": {...}}'`: the plugin's serving options, validated at startup.

Exactly one way to decide placement may be given; anything unknown or out of range is refused with
the key named, because a typo that silently serves everything from GPU memory would look like success
until the KV cache came out smaller than planned.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ..errors import ExpertOffloadError
from ..placement._atomic import replace_refusal
from ..validation import finite_number, refuse_unknown
from .cache_policy import CacheSettings, CacheSettingsError, parse_cache_settings
from .cpu_tier import CpuTierSettings, CpuTierSettingsError, parse_cpu_tier_settings

OPTION_KEY = "expert_offload"
# The EXL3 backends `kernel` may name; kernels/oracle.py decides which runs and refuses what cannot.
BACKENDS = ("auto", "cpu", "exllamav3", "triton", "torch")
_PLACEMENT_KEYS = ("plan", "gpu_budget_gib", "host_fraction")
_KNOWN = frozenset({*_PLACEMENT_KEYS, "stats", "record_stats", "record_stats_interval_s", "min_free_fraction", "kernel",
                    "dequantize_linears", "dynamic", "cpu_tier"})
T = TypeVar("T")
DEFAULT_MIN_FREE_FRACTION = 0.03
DEFAULT_RECORD_STATS_INTERVAL_S = 300.0
MIN_RECORD_STATS_INTERVAL_S = 1.0  # each save is an engine-wide RPC and a file write: not a busy loop


class OffloadOptionError(ExpertOffloadError, ValueError):
    pass


@dataclass(frozen=True)
class OffloadOptions:
    plan: Path | None = None
    gpu_budget_gib: float | None = None
    host_fraction: float | None = None
    stats: Path | None = None  # routing counts that steer a budget plan
    record_stats: Path | None = None  # where serving writes the counts it observes
    record_stats_interval_s: float = DEFAULT_RECORD_STATS_INTERVAL_S  # `vllm serve` rewrites record_stats this often
    min_free_fraction: float = DEFAULT_MIN_FREE_FRACTION  # GPU memory that must stay free after the KV cache
    kernel: str = "auto"  # one of BACKENDS: the EXL3 backend asked for (kernels/oracle.py decides and refuses)
    dequantize_linears: bool = False  # decode dense EXL3 linears once at load (memory for speed)
    dynamic: CacheSettings | None = None  # the GPU tier as an expert cache (docs/placement.md); None: static plan
    cpu_tier: CpuTierSettings | None = None  # host cores compute host-resident misses (offload/cpu_tier.py); None: off

    @property
    def offloads(self) -> bool:
        return any(v is not None for v in (self.plan, self.gpu_budget_gib, self.host_fraction))

    @property
    def caches(self) -> bool:
        """The GPU tier is asked to be an expert cache (a backend that cannot write through serves it static)."""
        return self.dynamic is not None and self.dynamic.enabled


def _where(key: str) -> str:
    return f'--additional-config {OPTION_KEY}.{key}'


def _number(raw: dict[str, Any], key: str, lo: float, hi: float, default: float | None = None) -> float | None:
    return finite_number(raw[key], _where(key), OffloadOptionError, lo, hi) if key in raw else default


def _path(raw: dict[str, Any], key: str, must_exist: bool) -> Path | None:
    if key not in raw:
        return None
    if not isinstance(raw[key], str) or not raw[key]:
        raise OffloadOptionError(f"{_where(key)}: expected a file path, got {raw[key]!r}")
    path = Path(raw[key]).expanduser()
    if must_exist and not path.is_file():
        raise OffloadOptionError(f"{_where(key)}: {path} does not exist")
    return path


def _output_path(raw: dict[str, Any], key: str) -> Path | None:
    """A file the plugin will write while serving: absent or a regular file (each save renames a new file over it,
    so a FIFO, a device node such as /dev/null, a socket or a symbolic link there would be replaced; they are
    refused, untouched), in an existing directory that takes a new file now, so a typo or a read-only mount is
    refused at startup instead of being found at the first save, hours into serving."""
    path = _path(raw, key, must_exist=False)
    if path is None:
        return None
    what = replace_refusal(path)
    if what is not None:
        raise OffloadOptionError(f"{_where(key)}: {path} is {what}; expected a regular file or a new file's path")
    directory = path.parent
    if not directory.is_dir():
        raise OffloadOptionError(f"{_where(key)}: directory {directory} of {path} does not exist")
    try:  # the file is written as a temporary file in this directory, then renamed (placement/_atomic.py)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise OffloadOptionError(f"{_where(key)}: directory {directory} of {path} is not writable ({exc})") from None
    return path


def _choice(raw: dict[str, Any], key: str, allowed: tuple[str, ...], default: str) -> str:
    value = raw.get(key, default)
    if value not in allowed:
        raise OffloadOptionError(f"{_where(key)}: {value!r} is not one of {list(allowed)}")
    return value


def _flag(raw: dict[str, Any], key: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise OffloadOptionError(f"{_where(key)}: expected true or false, got {value!r}")
    return value


_PARSED: dict[str, OffloadOptions] = {}  # this process's options, by their JSON text


def parse_offload_options(additional_config: dict[str, Any] | None) -> OffloadOptions:
    """The `expert_offload` object of vLLM's additional_config, parsed once per process: the API process checks
    it before any engine starts and the first EXL3 layer reads it again, in the same process under `LLM(...)` or
    without multiprocessing; both get the same frozen OffloadOptions (a refusal is not kept: it raises each time)."""
    raw = (additional_config or {}).get(OPTION_KEY)
    key = json.dumps(raw, sort_keys=True, default=repr)
    if key not in _PARSED:
        _PARSED[key] = _parse(raw)
    return _PARSED[key]


def _parse(raw: Any) -> OffloadOptions:
    if raw is None:
        return OffloadOptions()
    if not isinstance(raw, dict):
        raise OffloadOptionError(f"--additional-config {OPTION_KEY}: expected an object, got {raw!r}")
    refuse_unknown(raw, _KNOWN, f"--additional-config {OPTION_KEY}", OffloadOptionError, "unknown option")
    given = [k for k in _PLACEMENT_KEYS if k in raw]
    if len(given) > 1:
        raise OffloadOptionError(f"--additional-config {OPTION_KEY}: give one of {list(_PLACEMENT_KEYS)}, not {given}")
    if "stats" in raw and "gpu_budget_gib" not in raw:
        raise OffloadOptionError(f"{_where('stats')}: only used together with gpu_budget_gib")
    if "record_stats_interval_s" in raw and "record_stats" not in raw:
        raise OffloadOptionError(f"{_where('record_stats_interval_s')}: only used together with record_stats")
    if "dynamic" in raw and not any(k in raw for k in _PLACEMENT_KEYS):
        raise OffloadOptionError(f"{_where('dynamic')}: only used together with one of {list(_PLACEMENT_KEYS)} "
                                 "(without a host tier there is nothing to cache)")
    if "cpu_tier" in raw and not any(k in raw for k in _PLACEMENT_KEYS):
        raise OffloadOptionError(f"{_where('cpu_tier')}: only used together with one of {list(_PLACEMENT_KEYS)} "
                                 "(without a host tier no expert is on the host to compute there)")
    return OffloadOptions(
        plan=_path(raw, "plan", must_exist=True),
        gpu_budget_gib=_number(raw, "gpu_budget_gib", 0.0, 1e6),
        host_fraction=_number(raw, "host_fraction", 0.0, 1.0),
        stats=_path(raw, "stats", must_exist=True),
        record_stats=_output_path(raw, "record_stats"),
        record_stats_interval_s=_number(raw, "record_stats_interval_s", MIN_RECORD_STATS_INTERVAL_S, math.inf,
                                        DEFAULT_RECORD_STATS_INTERVAL_S),
        min_free_fraction=_number(raw, "min_free_fraction", 0.0, 0.5, DEFAULT_MIN_FREE_FRACTION),
        kernel=_choice(raw, "kernel", BACKENDS, "auto"),
        dequantize_linears=_flag(raw, "dequantize_linears"),
        dynamic=_section(raw, "dynamic", parse_cache_settings, CacheSettingsError),
        cpu_tier=_section(raw, "cpu_tier", parse_cpu_tier_settings, CpuTierSettingsError),
    )


def _section(raw: dict[str, Any], key: str, parse: Callable[[Any, str], T], error: type[ExpertOffloadError]) -> T | None:
    """A nested object (`dynamic`, `cpu_tier`) parsed by its own module's reader; its refusals become this
    module's, naming the key."""
    if key not in raw:
        return None
    try:
        return parse(raw[key], _where(key))
    except error as exc:
        raise OffloadOptionError(str(exc)) from None
