"""A persistent cache of compiled grammars on disk, for backends whose compiled form loads much faster than it builds.

Only outlines-core qualifies: its ``Index`` pickles in 1-5 ms against 0.1-5 s to build. xgrammar's compiled grammar
serializes slower than it compiles and loads in about one compile (a 14-56 MB JSON for the extraction schemas of
benchmarks/speed_suite), and llguidance compiles in about 1 ms: neither is stored (docs/benchmarks.md).

An entry's file name is the SHA-256 of everything the compiled grammar depends on: the backend and its package
version, the tokenizer's vocabulary as the backend sees it, the EOS ids, the grammar options, the grammar kind and
text. Files are written whole (temporary file, then rename), so concurrent grammar workers and restarts share the
folder safely; the oldest files go when the folder grows past its size bound.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
from importlib import metadata
from pathlib import Path

logger = logging.getLogger(__name__)

PERSISTED_BACKENDS = ("outlines",)
PACKAGE_OF = {"outlines": "outlines_core", "xgrammar": "xgrammar", "llguidance": "llguidance"}
FORMAT = "2"  # bump when what is stored changes, or how a grammar is rewritten before it compiles (schema_normalize)


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gramserve", "grammars")


def backend_fingerprint(backend) -> str:
    """What a compiled grammar of `backend` depends on besides the grammar itself."""
    try:
        version = metadata.version(PACKAGE_OF.get(backend.name, backend.name))
    except metadata.PackageNotFoundError:
        version = "unknown"
    h = hashlib.sha256()
    h.update(f"{FORMAT}|{backend.name}|{version}|{backend.vocab_size}|{backend.eos_token_ids}|".encode())
    h.update(repr(backend.options).encode())
    for tok in backend.vocab.tokens:
        h.update(b"\x00" if tok is None else len(tok).to_bytes(4, "little") + tok)
    return h.hexdigest()


class DiskCache:
    def __init__(self, directory: str, fingerprint: str, max_bytes: int = 2 << 30):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes

    def path(self, kind: str, text: str) -> Path:
        h = hashlib.sha256(f"{self.fingerprint}|{kind}|".encode() + text.encode("utf-8", "surrogatepass"))
        return self.dir / f"{h.hexdigest()}.pkl"

    def load(self, kind: str, text: str) -> object | None:
        path = self.path(kind, text)
        try:
            data = path.read_bytes()
            os.utime(path)  # recently used: pruned last
            return pickle.loads(data)
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - a damaged entry is a miss, and goes
            logger.warning("dropping unreadable grammar cache entry %s: %s", path.name, exc)
            path.unlink(missing_ok=True)
            return None

    def store(self, kind: str, text: str, compiled: object) -> None:
        try:
            data = pickle.dumps(compiled, protocol=pickle.HIGHEST_PROTOCOL)
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path(kind, text))
            self._prune()
        except Exception as exc:  # noqa: BLE001 - a cache that cannot write is only slower
            logger.warning("cannot store a compiled grammar in %s: %s", self.dir, exc)

    def _prune(self) -> None:
        entries = []
        for p in self.dir.glob("*.pkl"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
