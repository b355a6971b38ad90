"""gramserve: an LLM server built for structured generation. `gramserve.Engine` runs it in-process (engine.py)."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "Engine":  # imported on first use: `import gramserve` stays light for the child processes
        from gramserve.engine import Engine

        return Engine
    raise AttributeError(f"module 'gramserve' has no attribute {name!r}")
