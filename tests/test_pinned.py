"""Exact-size pinned host tensors ([Note: exact-size pinned memory] in memory/pinned.py),
with the driver calls replaced by a recorder: what is registered (whole pages, none
shared), when it is unregistered, and the error when registering fails. tests/test_gpu.py
checks them on a real device."""

from __future__ import annotations

import gc
import mmap

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
    assert t.numel() == nbytes // 4 and t.data_ptr() % mmap.PAGESIZE == 0
    ((ptr, locked),) = driver["registered"].items()
    storage = t.untyped_storage()
    assert t.data_ptr() == ptr and nbytes <= locked < nbytes + mmap.PAGESIZE
    # The storage starts at the registered pages: torch's is_pinned asks about its first byte.
    assert storage.data_ptr() == ptr and storage.nbytes() <= locked
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
    assert out.data_ptr() in driver["registered"]


def test_registering_that_fails_raises_one_clear_error(driver):
    driver["fail"] = 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match=r"cannot pin 8,192 bytes .* error 2\).*ulimit -l"):
        pinned.pinned_empty(1000, torch.float64)
    assert driver["registered"] == {}


def test_registrations_never_share_a_page(driver):
    """The driver refuses a range overlapping one already registered: small tensors, which
    the heap packs together, each get whole pages of their own."""
    kept = [pinned.pinned_empty(n, torch.float32) for n in (1, 10, 100, 1000, 3000)]
    spans = sorted((ptr, ptr + n) for ptr, n in driver["registered"].items())
    assert len(spans) == 5
    assert all(a % mmap.PAGESIZE == 0 and (b - a) % mmap.PAGESIZE == 0 for a, b in spans)
    assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))
    for t, (ptr, _) in zip(sorted(kept, key=lambda t: t.data_ptr()), spans):
        assert t.data_ptr() == ptr


def test_an_empty_tensor_locks_nothing(driver):
    """An empty tensor's ``data_ptr()`` is 0, which the driver refuses: it is not registered
    (a tied head's unit owns no parameter: its shard is empty)."""
    t = pinned.pinned_empty(0, torch.float32)
    assert t.shape == (0,) and t.dtype == torch.float32 and driver["registered"] == {}
    assert pinned.pinned_copy(torch.empty(0, 4, dtype=torch.bfloat16)).shape == (0, 4)
    assert driver["registered"] == {}
