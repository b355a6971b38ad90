"""gramserve's parts import one way: from the server down to the base types, never back up.

Every module belongs to one part: the longest matching prefix in `PARTS`. A module may import modules of its own
part and of the parts that `MAY_IMPORT` lists for it; every import counts (module level, inside functions, under
TYPE_CHECKING). The layers, top down:

    entry (cli, __main__, the package's lazy `gramserve.Engine`)
    extract                 engine, base                            (`gramserve extract`'s job)
    engine                  server, base                            (the in-process Engine)
    server                  anything below
    scheduler               grammar protocol, model, sampling, base
    detokenizer             base
    grammar                 grammar protocol, sampling, base        (backends, service, worker, compile workers)
    grammar protocol        sampling, base                          (grammar_shm, token_feed: the scheduler's share)
    model, parsers          base
    sampling                base
    base                    nothing else (config, ipc, messages, host_memory, histogram, gc_pauses, native,
                            sampling.params)

So the scheduler process loads no grammar backend code, and the grammar workers load no model code. Read
statically with `ast`, without importing anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gramserve"

PARTS = {
    "gramserve": "entry",  # the package's __init__: offers gramserve.Engine (only the package itself: see below)
    "gramserve.config": "base",
    "gramserve.ipc": "base",
    "gramserve.messages": "base",
    "gramserve.host_memory": "base",
    "gramserve.histogram": "base",
    "gramserve.gc_pauses": "base",
    "gramserve.native": "base",
    "gramserve.sampling.params": "base",
    "gramserve.sampling": "sampling",
    "gramserve.model": "model",
    "gramserve.parsers": "parsers",
    "gramserve.multimodal": "multimodal",
    "gramserve.grammar.grammar_shm": "grammar protocol",
    "gramserve.grammar.token_feed": "grammar protocol",
    "gramserve.grammar": "grammar",
    "gramserve.detokenizer": "detokenizer",
    "gramserve.scheduler": "scheduler",
    "gramserve.server": "server",
    "gramserve.engine": "engine",
    "gramserve.extract": "extract",
    "gramserve.cli": "entry",
    "gramserve.__main__": "entry",
}

MAY_IMPORT = {
    "base": set(),
    "sampling": {"base"},
    "model": {"base"},
    "parsers": {"base"},
    "multimodal": {"model", "base"},
    "grammar protocol": {"sampling", "base"},
    "grammar": {"grammar protocol", "sampling", "base"},
    "detokenizer": {"base"},
    "scheduler": {"grammar protocol", "model", "sampling", "base"},
    "server": {
        "scheduler",
        "detokenizer",
        "grammar",
        "grammar protocol",
        "parsers",
        "multimodal",
        "model",
        "sampling",
        "base",
    },
    "engine": {"server", "base"},
    "extract": {"engine", "base"},
    "entry": {"extract", "engine", "server", "base"},
}


def part_of(module: str) -> str:
    """The part of a gramserve module: the longest prefix of it in `PARTS` (other than the bare package, which
    names the part of its own __init__ only)."""
    name = module
    while name not in PARTS or (name == "gramserve" and module != "gramserve"):
        if "." not in name:
            raise KeyError(f"{module} belongs to no part: add it to PARTS")
        name = name.rsplit(".", 1)[0]
    return PARTS[name]


def package_modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Module name -> file, for every module of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(module: str, source: str, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, gramserve module) for each gramserve import in `source`. `from a import b` counts as importing
    `a.b` when that is a module, else `a`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.append((node.lineno, target if target in known else base))
    return [(line, name) for line, name in found if name == "gramserve" or name.startswith("gramserve.")]


def import_edges(sources: dict[str, tuple[str, bool]]) -> list[tuple[str, int, str]]:
    """(module, line, imported module) over `sources`: module -> (source text, is a package)."""
    known = set(sources)
    return [
        (module, line, target)
        for module, (text, is_package) in sources.items()
        for line, target in imports_of(module, text, is_package, known)
    ]


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    out = []
    for module, line, target in import_edges(sources):
        mine, theirs = part_of(module), part_of(target)
        if theirs != mine and theirs not in MAY_IMPORT[mine]:
            out.append(f"{module}:{line} imports {target} ({mine} may not import {theirs})")
    return out


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of a directed graph (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def read_package() -> dict[str, tuple[str, bool]]:
    return {name: (path.read_text(), path.name == "__init__.py") for name, path in package_modules().items()}


def test_every_import_follows_the_layers():
    bad = violations(read_package())
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_the_layers_have_no_cycle():
    assert cycle(MAY_IMPORT) is None
    assert set(PARTS.values()) == set(MAY_IMPORT)


def test_no_cycle_between_subpackages():
    """At the granularity of gramserve's subpackages and top-level modules (config, ipc, messages, ...)."""

    def top(module: str) -> str:
        return ".".join(module.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for module, _, target in import_edges(read_package()):
        if top(module) != top(target) and target != "gramserve":
            graph.setdefault(top(module), set()).add(top(target))
    assert cycle(graph) is None, f"import cycle: {' -> '.join(cycle(graph))}"


@pytest.mark.parametrize(
    "module,source,expected",
    [
        # the cycle this layering removed: sampling reaching into the grammar backends
        (
            "gramserve.sampling.grammar_masks",
            "from gramserve.grammar.backends.base import apply_bitmask",
            "sampling may not import grammar",
        ),
        (
            "gramserve.scheduler.grammar_client",
            "def f():\n    from gramserve.grammar.service import GrammarService",
            "scheduler may not import grammar",
        ),
        ("gramserve.grammar.worker", "import gramserve.model.runner", "grammar may not import model"),
        ("gramserve.messages", "from gramserve.sampling import sampler", "base may not import sampling"),
        (
            "gramserve.grammar.backends.xgrammar_backend",
            "from ...scheduler.grammar_slots import SlotTable",
            "grammar may not import scheduler",
        ),
    ],
)
def test_a_forbidden_import_is_caught(module, source, expected):
    sources = {name: ("", False) for name in package_modules()}
    sources[module] = (source, False)
    bad = violations(sources)
    assert len(bad) == 1 and expected in bad[0], bad


def test_allowed_imports_pass():
    sources = {name: ("", False) for name in package_modules()}
    sources["gramserve.scheduler.grammar_client"] = ("from gramserve.grammar import token_feed", False)
    backends = "from .base import GrammarSpec\nfrom gramserve.sampling.bitmask import bitmask_words"
    sources["gramserve.grammar.backends"] = (backends, True)
    assert violations(sources) == []


def test_cycles_are_found():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
