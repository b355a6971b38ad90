"""Write the JSON-Schema-Test-Suite (draft 2020-12) as a corpus folder in the layout of ../shared/corpora.

The official test suite has one small schema per keyword case, with valid and invalid instances: the
"synthesized feature tests" kind of schema that exercises every keyword (not, if/then/else, uniqueItems,
dependentSchemas, contains, unevaluated*, $dynamicRef, ...). It ships inside the `jsonschema` source
distribution on PyPI, so this script downloads that (``pip download``, the package registry only) unless
``--sdist`` names one, and writes ``Feature_<keyword>---<n>.json`` files, each
``{"description", "schema", "tests": [{"description", "data", "valid"}]}``. The ``optional/`` cases (format
assertions, bignum, ...) are left out, as are the groups whose schema refers to a remote document.

Used by bench_schema_coverage.py and bench_corpus_validity.py (``--corpus DIR``).

Example::

    python benchmarks/feature_corpus.py --out /tmp/feature-corpus
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SUITE_DIR = "json/tests/draft2020-12/"


def download_sdist(dest: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-binary",
            ":all:",
            "--no-deps",
            "jsonschema",
            "-d",
            str(dest),
        ],
        check=True,
    )
    return next(dest.glob("jsonschema-*.tar.gz"))


def remote(schema) -> bool:
    text = json.dumps(schema)
    return "http://localhost" in text or "urn:" in text or "$dynamicRef" in text


def write_corpus(sdist: Path, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = member.name
            if SUITE_DIR not in name or not name.endswith(".json") or "/optional/" in name:
                continue
            keyword = Path(name).stem.replace("-", "")
            groups = json.load(tar.extractfile(member))
            for i, group in enumerate(groups):
                if remote(group["schema"]):
                    continue
                doc = {"description": group["description"], "schema": group["schema"], "tests": group["tests"]}
                (out / f"Feature_{keyword}---{i}.json").write_text(json.dumps(doc))
                written += 1
    return written


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sdist", type=Path, help="a jsonschema-*.tar.gz already downloaded")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or download_sdist(Path(tmp))
        n = write_corpus(sdist, args.out)
    print(f"{n} schemas written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
