"""This host's memory: what is available now (the kernel's MemAvailable), for checks made before loading."""

from __future__ import annotations


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, or None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
