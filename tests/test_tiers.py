"""The tier layer (memory/tiers.py): where each unit's shards live, and that the engine
places them, fetches them and adds gradients into them through that one decision."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gpt2

import zerotune
from zerotune.config import ZeroConfig
from zerotune.memory.tiers import (
    DeviceParams,
    MemoryGrads,
    NvmeGrads,
    NvmeParams,
    placement,
)
from zerotune.sharding.unit import UnitState


def _where(device="cuda", dtype=2, persistent=False, trainable=True, grads_on_disk=False, **cfg):
    nvme = "nvme" in cfg.values()
    config = ZeroConfig.from_dict({"stage": 3, **cfg, **({"nvme_path": "/unused"} if nvme else {})})
    return placement(
        config,
        persistent=persistent,
        numel=64,
        trainable=trainable,
        itemsize=dtype,
        grads_on_disk=grads_on_disk,
        device_type=device,
    )


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        # (params, master, grads, separate master)
        ({}, ("device", "device", "device", True)),
        ({"dtype": 4}, ("device", "device", "device", False)),
        ({"offload_optimizer": "cpu"}, ("device", "host", "host", True)),
        # fp32 on an accelerator with the optimizer on the host: a host copy of the master
        ({"dtype": 4, "offload_optimizer": "cpu"}, ("device", "host", "host", True)),
        # ... which on a CPU is the parameter shard itself
        (
            {"dtype": 4, "offload_optimizer": "cpu", "device": "cpu"},
            ("device", "host", "host", False),
        ),
        # fp32 parameters on the host: the master is that shard, gradients go to the host
        ({"dtype": 4, "offload_param": "cpu"}, ("host", "host", "host", False)),
        ({"offload_param": "cpu"}, ("host", "device", "device", True)),
        ({"offload_param": "cpu", "persistent": True}, ("device", "device", "device", True)),
        ({"offload_optimizer": "nvme"}, ("device", "nvme", "host", False)),
        ({"offload_optimizer": "nvme", "grads_on_disk": True}, ("device", "nvme", "nvme", False)),
        # a frozen unit keeps its master in memory and never has a gradient file
        (
            {"offload_optimizer": "nvme", "grads_on_disk": True, "trainable": False},
            ("device", "device", "host", True),
        ),
        (
            {"offload_param": "nvme", "offload_optimizer": "nvme"},
            ("nvme", "nvme", "host", False),
        ),
        # fp32 with both tiers on NVMe: the parameter extent holds the master
        (
            {"offload_param": "nvme", "offload_optimizer": "nvme", "dtype": 4},
            ("nvme", "param_file", "host", False),
        ),
        # fp32 parameters on NVMe, optimizer in memory: the master tensor stays
        ({"offload_param": "nvme", "dtype": 4}, ("nvme", "device", "device", True)),
    ],
)
def test_placement(kwargs, expected):
    where = _where(**kwargs)
    assert (where.params, where.master, where.grads, where.separate_master) == expected
    assert where.master_in_param_file == (expected[1] == "param_file")


CONFIGS = [
    {"stage": 3},
    {"stage": 3, "offload_optimizer": "cpu"},
    {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme"},
    {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "grad_host_bytes": 0},
    {"stage": 3, "offload_param": "nvme", "dtype": "bf16"},
    {"stage": 2, "offload_optimizer": "nvme", "dtype": "bf16", "grad_host_bytes": 0},
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_engine_places_units_as_placement_says(tmp_path, config):
    nvme = {"nvme_path": str(tmp_path)} if "nvme" in config.values() else {}
    engine = zerotune.shard(tiny_gpt2(seed=0), {**config, **nvme})
    try:
        cfg = engine.config
        for u in engine.units:
            where = placement(
                cfg,
                persistent=u.persistent,
                numel=u.numel,
                trainable=u.trainable,
                itemsize=torch.finfo(u.dtype).bits // 8,
                grads_on_disk=engine._grads_on_disk,
                device_type="cpu",
            )
            assert u.placement == where, u.name
            params = {"nvme": NvmeParams}.get(where.params, DeviceParams)
            assert type(u.params) is params, u.name
            assert type(u.grads) is (NvmeGrads if where.grads == "nvme" else MemoryGrads)
            if not u.numel:
                continue
            # The bytes in memory follow the placement: no shard of a tier on NVMe.
            report = u.memory_bytes()
            assert (report["params"] == 0) == (where.params == "nvme")
            assert (report["master"] > 0) == where.separate_master
            if where.master in ("nvme", "param_file"):
                assert u.master is None
    finally:
        engine.close()


def _grads_by_tier(tmp_path, grad_host_bytes):
    """Gradient shards after two micro-batches, read back through the gradient tier."""
    tmp_path.mkdir()
    engine = zerotune.shard(
        tiny_gpt2(seed=0),
        {
            "stage": 3,
            "offload_optimizer": "nvme",
            "grad_host_bytes": grad_host_bytes,
            "nvme_path": str(tmp_path),
        },
    )
    try:
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            ids = torch.randint(0, 96, (2, 8), generator=g)
            engine(input_ids=ids, labels=ids).loss.backward()
        engine.finalize_grads()
        out = {}
        for u in engine.units:
            if u.trainable:
                parts = [grad.clone() for _, _, grad in engine.grad_chunks(u)]
                out[u.name] = (type(u.grads), torch.cat(parts))
        return out
    finally:
        engine.close()


def test_gradient_tiers_accumulate_the_same_sums(tmp_path):
    in_memory = _grads_by_tier(tmp_path / "a", 1 << 40)
    on_disk = _grads_by_tier(tmp_path / "b", 0)
    assert in_memory.keys() == on_disk.keys()
    for name, (kind, grad) in in_memory.items():
        disk_kind, disk_grad = on_disk[name]
        assert kind is MemoryGrads and disk_kind is NvmeGrads, name
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(disk_grad, grad, rtol=0, atol=0)


def test_a_failed_fetch_leaves_the_unit_sharded(tmp_path, monkeypatch):
    config = {
        "stage": 3,
        "offload_param": "nvme",
        "map_param_file": False,
        "nvme_path": str(tmp_path),
    }
    engine = zerotune.shard(tiny_gpt2(seed=0), config)
    try:
        unit = next(u for u in engine.units if u.placement.params == "nvme" and u.numel)
        assert unit.params.mapped is False
        unit.gather()
        want = unit.flat.clone()
        unit.release()
        file = unit.params.extent.file
        real_read = type(file).read

        class Broken:
            def wait(self):
                raise OSError(5, "Input/output error")

            def done(self):
                return True

        monkeypatch.setattr(type(file), "read", lambda self, *a, **k: Broken())
        with pytest.raises(OSError, match="Input/output error"):
            unit.gather()
        assert unit.state is UnitState.SHARDED
        assert unit.flat.untyped_storage().nbytes() == 0
        assert all(s.param.numel() == 0 for s in unit.slots)
        monkeypatch.setattr(type(file), "read", real_read)
        unit.gather()
        assert unit.state is UnitState.GATHERED
        torch.testing.assert_close(unit.flat, want, rtol=0, atol=0)
        unit.release()
    finally:
        engine.close()
