"""Where the tests find the repository, its carried fixtures and the optional ../shared reference material."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
SHARED = REPO.parent / "shared"  # present on the project machines and in CI; tests that need it skip without it
