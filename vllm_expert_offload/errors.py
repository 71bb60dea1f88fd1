"""The base of every refusal the plugin raises, so callers and tests can catch the whole family at once.

Each subclass keeps the builtin base its callers already expect (ValueError for bad input, RuntimeError for a
backend or hook that cannot run), so vLLM's own error handling around a refused config still applies. A leaf
module: importable from every layer, importing nothing of the package.
"""

from __future__ import annotations


class ExpertOffloadError(Exception):
    """Something the plugin refuses, with the key, tensor, flag or file at fault named in the message."""
