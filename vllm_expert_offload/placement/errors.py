"""The placement layer's refusal: a plan, statistics file, ledger or matrix that cannot be used, named."""

from __future__ import annotations

from ..errors import ExpertOffloadError


class PlacementError(ExpertOffloadError, ValueError):
    """A plan file, routing-statistics file or placement input refused, with the file, key or value named."""
