"""benchmarks/held_out_corpus.py: the held-out families it writes stand alone (every $ref resolves inside the
schema) and keep their meaning. Built from small wheels laid out as the real ones are (no download)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import jsonschema
import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def corpus_module():
    return load_benchmark("held_out_corpus")


def wheel(path: Path, files: dict[str, object]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, doc in files.items():
            zf.writestr(name, json.dumps(doc))
    return path


def test_kubernetes_schemas_carry_the_definitions_they_reach(tmp_path, corpus_module):
    defs = {
        "$defs": {
            "io.k8s.Meta": {"type": "object", "properties": {"labels": {"$ref": "#/$defs/io.k8s.Labels"}}},
            "io.k8s.Labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "io.k8s.Unused": {"type": "integer"},
        }
    }
    pod = {
        "type": "object",
        "properties": {"metadata": {"$ref": "/api/_definitions.json#/$defs/io.k8s.Meta"}},
        "required": ["metadata"],
        "additionalProperties": False,
    }
    root = "kubernetes_validate/kubernetes-json-schema/"
    kv = wheel(
        tmp_path / "kv.whl",
        {
            f"{root}v1.9.0-local-strict/_definitions.json": defs,
            f"{root}v1.9.0-local-strict/pod-v1.json": pod,
            f"{root}v1.10.0-local-strict/_definitions.json": defs,
            f"{root}v1.10.0-local-strict/pod-v1.json": pod,
            f"{root}v1.10.0-local-strict/all.json": {},
            f"{root}v1.11.0-local/pod-v1.json": {"not": "strict"},
        },
    )
    out = tmp_path / "corpus"
    out.mkdir()
    assert corpus_module.write_kubernetes(kv, out) == 1  # the newest strict release (1.10 over 1.9), "all" left out
    schema = json.loads((out / "Kubernetes---pod-v1.json").read_text())["schema"]
    assert schema["properties"]["metadata"] == {"$ref": "#/$defs/io.k8s.Meta"}
    assert sorted(schema["$defs"]) == ["io.k8s.Labels", "io.k8s.Meta"]
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"metadata": {"labels": {"app": "web"}}})
    assert not validator.is_valid({"metadata": {"labels": {"app": 1}}})


def test_schemastore_and_cloudformation_schemas_are_written_as_shipped(tmp_path, corpus_module):
    store = {"type": "object", "properties": {"on": {"type": "string"}}}
    resource = {"typeName": "AWS::S3::Bucket", "type": "object", "properties": {"BucketName": {"type": "string"}}}
    cj = wheel(tmp_path / "cj.whl", {"check_jsonschema/builtin_schemas/vendor/github-workflows.json": store})
    cfn = wheel(tmp_path / "cfn.whl", {"cfnlint/data/schemas/resources/0a1b.json": resource})
    out = tmp_path / "corpus"
    out.mkdir()
    assert corpus_module.write_schemastore(cj, out) == 1
    assert corpus_module.write_cloudformation(cfn, out) == 1
    assert json.loads((out / "SchemaStore---github-workflows.json").read_text())["schema"] == store
    doc = json.loads((out / "CloudFormation---AWS_S3_Bucket.json").read_text())
    assert doc["schema"] == resource and doc["tests"] == []
