"""gc_pauses.py: the start-up heap frozen, and a slow full collection logged."""

from __future__ import annotations

import gc
import logging

import pytest

from gramserve import gc_pauses


@pytest.fixture
def restore_gc():
    callbacks = list(gc.callbacks)
    yield
    gc.callbacks[:] = callbacks
    gc.unfreeze()


def test_freeze_heap_hides_the_start_up_objects_from_full_collections(restore_gc, monkeypatch, caplog):
    held = [[i] for i in range(200_000)]  # what a process holds once ready: a vocabulary, modules, ...
    before = gc.get_freeze_count()
    gc_pauses.freeze_heap("test process")
    assert gc.get_freeze_count() >= before + len(held)
    gc_pauses.freeze_heap("test process")  # a second call adds no second watcher
    assert sum(getattr(cb, "gramserve_watch", False) for cb in gc.callbacks) == 1
    monkeypatch.setattr(gc_pauses, "SLOW_COLLECTION_MS", 0.0)
    with caplog.at_level(logging.WARNING, logger="gramserve.gc_pauses"):
        gc.collect()
    assert any("test process: a full garbage collection took" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(gc_pauses, "SLOW_COLLECTION_MS", 1e9)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gramserve.gc_pauses"):
        gc.collect()
    assert not caplog.records
    del held
