"""The base of every refusal the plugin raises, so callers and tests can catch the whole family at once.

Each subclass keeps the builtin base its callers already expect (ValueError for bad input, RuntimeError for a
backend or hook that cannot run), so vLLM's own error handling around a refused config still applies. A leaf
module: importable from every layer, importing nothing of the package.
"""

from __future__ import annotations


class ExpertOffloadError(Exception):
    """Something the plugin refuses, with the key, tensor, flag or file at fault named in the message."""


class InvalidValueError(ExpertOffloadError, ValueError):
    """A value the plugin was handed and cannot use (an argument, a tensor, an environment variable, a layer's
    shape) where no narrower family member says more; the message names it."""


class InvalidStateError(ExpertOffloadError, RuntimeError):
    """An operation asked of an object in a state that cannot serve it (a closed arena, views still alive, a step
    taken out of the order it needs); the message says which."""
