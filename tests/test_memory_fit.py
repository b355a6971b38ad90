"""A CPU model whose weights do not fit in the memory available is refused before any process starts, with a message
that says so (it used to fill the RAM until the OOM killer ended the scheduler: "exit code -9")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gramserve.config import ServerArgs
from gramserve.model.loader import load_config_dict
from gramserve.model.model_config import ModelConfig
from gramserve.server import processes
from gramserve.server.processes import StartupError, check_memory_fit
from gramserve.server.settings import resolve_settings

MODELS = Path(__file__).resolve().parents[1] / ".." / "shared" / "models"
TINY = Path(__file__).resolve().parent / "data" / "tiny_llama.json"


def test_weights_past_the_available_memory_are_refused(monkeypatch):
    args = ServerArgs(model_path=str(TINY), load_format="dummy", device="cpu")
    cfg = ModelConfig.from_dict(load_config_dict(str(TINY)))
    monkeypatch.setattr(processes, "available_memory_bytes", lambda: 64 * 2**30)
    check_memory_fit(args, resolve_settings(args), cfg)  # fits
    weights = cfg.num_params() * 4
    monkeypatch.setattr(processes, "available_memory_bytes", lambda: weights + 2**30)  # not the 2 GiB beside them
    with pytest.raises(StartupError, match=r"weights need .* GiB in float32 .* use a smaller model"):
        check_memory_fit(args, resolve_settings(args), cfg)
    monkeypatch.setattr(processes, "available_memory_bytes", lambda: None)  # not Linux: no check
    check_memory_fit(args, resolve_settings(args), cfg)


@pytest.mark.skipif(not (MODELS / "llama-3.1-8b.json").exists(), reason="no shared model configs")
def test_the_8b_shape_on_this_cpu_is_refused_at_once():
    cfg = ModelConfig.from_dict(load_config_dict(str(MODELS / "llama-3.1-8b.json")))
    available = processes.available_memory_bytes()
    if available is None or cfg.num_params() * 4 + 2 * 2**30 <= available:
        pytest.skip("this host could hold the 8B shape's float32 weights")
    cmd = [sys.executable, "-m", "gramserve", "serve", "--model-path", str(MODELS / "llama-3.1-8b.json")]
    done = subprocess.run([*cmd, "--load-format", "dummy", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "weights need" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
