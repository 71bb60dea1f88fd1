"""Reading the plugin's samples off a running server's /metrics (engine tests)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def plugin_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of every vllm_expert_offload sample the server exports now."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) if family.name.startswith("vllm_expert_offload")
            for s in family.samples}
