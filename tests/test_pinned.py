"""Exact-size pinned host tensors ([Note: exact-size pinned memory] in memory/pinned.py),
with the driver calls replaced by a recorder: what is registered, when it is unregistered,
and the fallback when registering fails. tests/test_gpu.py checks them on a real device."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from zerotune.memory import pinned

MiB = 2**20


@pytest.fixture
def driver(monkeypatch):
    """The (ptr, bytes) registered now; ``fail`` makes registering return an error."""
    state = {"registered": {}, "fail": 0, "unregistered": []}

    def register(ptr, nbytes):
        if state["fail"]:
            return state["fail"]
        assert ptr not in state["registered"]
        state["registered"][ptr] = nbytes
        return 0

    def unregister(ptr):
        state["unregistered"].append(state["registered"].pop(ptr))

    monkeypatch.setattr(pinned, "_register", register)
    monkeypatch.setattr(pinned, "_unregister", unregister)
    return state


def test_a_tensor_locks_its_own_size_until_its_last_view_is_gone(driver):
    nbytes = 5 * MiB + 4  # a power-of-two block would lock 8 MiB
    t = pinned.pinned_empty(nbytes // 4, torch.float32)
    assert t.numel() == nbytes // 4 and t.data_ptr() % 4096 == 0
    ((ptr, locked),) = driver["registered"].items()
    storage = t.untyped_storage()
    assert storage.data_ptr() == ptr and storage.nbytes() == locked
    assert nbytes <= locked <= nbytes + 2 * 4096
    view = t[100:200]
    del t, storage
    gc.collect()
    assert driver["registered"] == {ptr: locked}  # the view keeps the storage
    del view
    gc.collect()
    assert driver["registered"] == {} and driver["unregistered"] == [locked]


def test_a_copy_keeps_shape_dtype_and_values(driver):
    src = torch.arange(12, dtype=torch.bfloat16).view(3, 4)
    out = pinned.pinned_copy(src)
    assert out.shape == (3, 4) and out.dtype == torch.bfloat16 and torch.equal(out, src)
    assert out.untyped_storage().data_ptr() in driver["registered"]


def test_registering_that_fails_falls_back_to_torchs_pinned_blocks(driver, monkeypatch, caplog):
    driver["fail"] = 2  # cudaErrorMemoryAllocation
    made = []
    monkeypatch.setattr(pinned, "_fallback_logged", False)
    monkeypatch.setattr(
        pinned, "_torch_pinned", lambda n, d: made.append((n, d)) or torch.empty(n, dtype=d)
    )
    with caplog.at_level(logging.WARNING, logger="zerotune.memory.pinned"):
        a = pinned.pinned_empty(1000, torch.float32)
        b = pinned.pinned_empty(10, torch.float16)
    assert made == [(1000, torch.float32), (10, torch.float16)]
    assert a.numel() == 1000 and b.dtype == torch.float16
    assert len([r for r in caplog.records if "cudaHostRegister" in r.getMessage()]) == 1
    assert driver["registered"] == {}
