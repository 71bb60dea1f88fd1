"""Whether an address is mapped in this process: the evidence that an arena was unmapped, read from /proc."""

from __future__ import annotations


def is_mapped(address: int) -> bool:
    for line in open("/proc/self/maps"):
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return True
    return False
