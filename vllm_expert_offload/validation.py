"""The checks every config reader shares: unknown keys refused by name, numbers that are really numbers.

A typo in a config key that is silently ignored looks like success until the server behaves differently from
what was asked; a JSON number such as 1e999 or 10**400 must be refused with its key named, not crash deep
inside with an OverflowError. Each reader passes where the value comes from (`quantization_config`,
`--additional-config expert_offload`, a plan file's path) and the error class of its layer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .errors import ExpertOffloadError


def refuse_unknown(
    given: Iterable[str], known: Iterable[str], where: str, error: type[ExpertOffloadError], what: str = "unknown key",
    hint: str = "",
) -> None:
    """Raise `error` naming the first key of `given` outside `known` as `where.KEY: what (known: [...])hint`."""
    known = set(known)
    unknown = sorted(set(given) - known, key=str)
    if unknown:
        raise error(f"{where}.{unknown[0]}: {what} (known: {sorted(known)}){hint}")


def finite_number(value: object, where: str, error: type[ExpertOffloadError], lo: float = -math.inf,
                  hi: float = math.inf) -> float:
    """`value` as a float when it is a JSON number (not a bool) that fits a float, is finite and in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{where}: {value!r} is not a number")
    try:
        number = float(value)
    except OverflowError:
        raise error(f"{where}: an integer of {value.bit_length()} bits is too large for a number") from None
    if not math.isfinite(number):
        raise error(f"{where}: {value!r} is not a finite number")
    if not lo <= number <= hi:
        raise error(f"{where}: {value} is outside [{lo:g}, {hi:g}]")
    return number
