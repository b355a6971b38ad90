"""GPU tests: skipped without CUDA. Shared helpers: small model configs and a runner harness."""

from __future__ import annotations

import json

import pytest
import torch

if not torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def config_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-configs")


def write_config(folder, name: str, cfg: dict) -> str:
    path = folder / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)
