"""Byte units, defined once (a leaf module, importable from every layer)."""

from __future__ import annotations

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
