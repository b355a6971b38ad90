"""Write real-world schemas of held-out families (SchemaStore, Kubernetes, CloudFormation) as a corpus folder.

Issue 19 was measured on families that ../shared/corpora does not hold. Two of them ship on PyPI, and a third
family of hand-written real-world schemas too, so this script fetches them from the package registry (``pip
download``, no other network) unless the wheels are given:

- **SchemaStore**: the configuration-file schemas that `check-jsonschema` vendors from schemastore.org (GitHub
  workflows and actions, GitLab CI, Azure Pipelines, Compose, Renovate, Dependabot, ...; about 27, many of them
  large, with definitions, patternProperties, oneOf / anyOf and formats).
- **Kubernetes**: the per-kind schemas of one Kubernetes release that `kubernetes-validate` ships (the "strict"
  variant: additionalProperties false), about 770. Their ``$ref``\\s point into a shared ``_definitions.json``; each
  written schema carries the definitions it reaches under its own ``$defs``, so it stands alone (as the schemas
  of JSONSchemaBench's Kubernetes family do).
- **CloudFormation**: the AWS resource-provider schemas that `cfn-lint` ships (one per resource type, about 1,900):
  hand-maintained records with patterns, enums, numeric and length bounds, oneOf / anyOf, dependencies,
  uniqueItems and nested definitions, the kind of schema JSONSchemaBench's harder GitHub splits hold.

Each file is ``{"description", "schema", "tests": []}`` (no instances), named ``SchemaStore---<name>.json``,
``Kubernetes---<kind>.json`` or ``CloudFormation---<AWS_Service_Resource>.json``: the layout that
bench_schema_coverage.py and bench_corpus_validity.py read.

Example::

    python benchmarks/held_out_corpus.py --out /tmp/held-out
    python benchmarks/bench_schema_coverage.py --corpus /tmp/held-out
    # a sample of it (at most 62 schemas a family, chosen with seed 45), for runs with the default model on a CPU
    python benchmarks/held_out_corpus.py --sample-from /tmp/held-out --per-family 62 --seed 45 --out /tmp/sample
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGES = {
    "check-jsonschema": "check_jsonschema",
    "kubernetes-validate": "kubernetes_validate",
    "cfn-lint": "cfn_lint",
}
SCHEMASTORE_DIR = "check_jsonschema/builtin_schemas/vendor/"
K8S_ROOT = "kubernetes_validate/kubernetes-json-schema/"
CFN_DIR = "cfnlint/data/schemas/resources/"
K8S_REF = re.compile(r"^(.*_definitions\.json)?#/(\$defs|definitions)/(.+)$")  # into _definitions.json, or within it


def download(package: str, dest: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary",
            ":all:",
            package,
            "-d",
            str(dest),
        ],
        check=True,
    )
    return next(dest.glob(f"{PACKAGES[package]}-*.whl"))


def write_doc(out: Path, family: str, name: str, schema: dict, description: str) -> None:
    doc = {"description": description, "schema": schema, "tests": []}
    (out / f"{family}---{name}.json").write_text(json.dumps(doc))


def schemas_in(wheel: Path, folder: str):
    """(file name, schema) for each JSON file of a wheel's folder, in name order."""
    with zipfile.ZipFile(wheel) as zf:
        for name in sorted(zf.namelist()):
            if name.startswith(folder) and name.endswith(".json"):
                yield name, json.loads(zf.read(name))


def write_schemastore(wheel: Path, out: Path) -> int:
    written = 0
    for name, schema in schemas_in(wheel, SCHEMASTORE_DIR):
        stem = Path(name).stem
        write_doc(out, "SchemaStore", stem, schema, f"schemastore.org {stem} (vendored by check-jsonschema)")
        written += 1
    return written


def latest_strict_release(names: list[str]) -> str:
    releases = {n[len(K8S_ROOT) :].split("/")[0] for n in names if n.startswith(K8S_ROOT)}
    strict = [r for r in releases if r.endswith("-local-strict")]

    def version(release: str) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", release.split("-")[0]))

    return max(strict, key=version)


def localize(node, definitions: dict, needed: set[str]):
    """The node with every ref into _definitions.json made local (#/$defs/NAME); the names it reaches go to needed."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and (m := K8S_REF.match(value)):
                name = m.group(3)
                needed.add(name)
                out[key] = f"#/$defs/{name}"
            else:
                out[key] = localize(value, definitions, needed)
        return out
    if isinstance(node, list):
        return [localize(v, definitions, needed) for v in node]
    return node


def standalone(schema: dict, definitions: dict) -> dict:
    needed: set[str] = set()
    root = localize(schema, definitions, needed)
    defs: dict = {}
    todo = list(needed)
    while todo:
        name = todo.pop()
        if name in defs:
            continue
        reached: set[str] = set()
        defs[name] = localize(definitions[name], definitions, reached)
        todo.extend(reached - defs.keys())
    if defs:
        root["$defs"] = {k: defs[k] for k in sorted(defs)}
    return root


def write_kubernetes(wheel: Path, out: Path) -> int:
    with zipfile.ZipFile(wheel) as zf:
        release = latest_strict_release(zf.namelist())
        folder = f"{K8S_ROOT}{release}/"
        shared = json.loads(zf.read(folder + "_definitions.json"))
    definitions = shared.get("$defs") or shared.get("definitions") or {}
    written = 0
    for name, schema in schemas_in(wheel, folder):
        stem = Path(name).stem
        if stem not in ("_definitions", "all"):
            write_doc(
                out,
                "Kubernetes",
                stem,
                standalone(schema, definitions),
                f"Kubernetes {release} {stem} (kubernetes-validate)",
            )
            written += 1
    return written


def write_cloudformation(wheel: Path, out: Path) -> int:
    written = 0
    for name, schema in schemas_in(wheel, CFN_DIR):
        type_name = schema.get("typeName") or Path(name).stem
        write_doc(out, "CloudFormation", type_name.replace("::", "_"), schema, f"{type_name} (cfn-lint)")
        written += 1
    return written


def write_sample(corpus: Path, out: Path, per_family: int, seed: int) -> dict[str, int]:
    """Copy at most `per_family` schemas of each family of `corpus` to `out`, chosen at random with `seed`."""
    families: dict[str, list[Path]] = {}
    for path in sorted(corpus.glob("*---*.json")):
        families.setdefault(path.name.split("---")[0], []).append(path)
    rng = random.Random(seed)
    counts = {}
    for family, paths in families.items():
        chosen = paths if len(paths) <= per_family else rng.sample(paths, per_family)
        for path in chosen:
            shutil.copy(path, out / path.name)
        counts[family] = len(chosen)
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sample-from", type=Path, help="a corpus this script wrote: write a sample of it instead")
    p.add_argument("--per-family", type=int, default=62, help="with --sample-from: at most this many a family")
    p.add_argument("--seed", type=int, default=0, help="with --sample-from: the sample's seed")
    p.add_argument("--check-jsonschema-wheel", type=Path, help="a check_jsonschema-*.whl already downloaded")
    p.add_argument("--kubernetes-validate-wheel", type=Path, help="a kubernetes_validate-*.whl already downloaded")
    p.add_argument("--cfn-lint-wheel", type=Path, help="a cfn_lint-*.whl already downloaded")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sample_from is not None:
        counts = write_sample(args.sample_from, args.out, args.per_family, args.seed)
        print(f"sample of {args.sample_from} written to {args.out}: {counts}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        cj = args.check_jsonschema_wheel or download("check-jsonschema", Path(tmp))
        kv = args.kubernetes_validate_wheel or download("kubernetes-validate", Path(tmp))
        n_store = write_schemastore(cj, args.out)
        cfn = args.cfn_lint_wheel or download("cfn-lint", Path(tmp))
        n_k8s = write_kubernetes(kv, args.out)
        n_cfn = write_cloudformation(cfn, args.out)
    print(f"{n_store} SchemaStore, {n_k8s} Kubernetes and {n_cfn} CloudFormation schemas written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
