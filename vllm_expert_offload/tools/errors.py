"""The commands' own refusals, in the ExpertOffloadError family so cli.py prints every one as a single line.

Input errors keep ValueError as their builtin base and run errors RuntimeError, as the rest of the family does.
"""

from __future__ import annotations

from ..errors import ExpertOffloadError


class ToolInputError(ExpertOffloadError, ValueError):
    """A flag, file or server reply a command cannot use; the message names the flag or file at fault."""


class ToolRunError(ExpertOffloadError, RuntimeError):
    """Something a command ran (a child process, a server) failed; the message says what and how."""
