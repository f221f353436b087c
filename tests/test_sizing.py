"""One sizing model: the working buffers ``zerotune estimate`` plans are the ones real engines
allocate (see [Note: working buffers] in sharding/buffers.py), byte for byte."""

from __future__ import annotations

import pytest
from conftest import run_world

STAGING = 3 * 16 * 4096 * 3  # several optimizer chunks per unit
# (model, config); nvme_path is filled in per test.
SIZING_CASES = [
    ("gpt2", {"stage": 3}),
    ("gpt2", {"stage": 2, "dtype": "bf16"}),
    ("gpt2", {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"}),
    ("gpt2", {"stage": 2, "dtype": "bf16", "offload_optimizer": "cpu"}),
    (
        "gpt2",
        {
            "stage": 3,
            "offload_param": "nvme",
            "offload_optimizer": "nvme",
            "staging_bytes": STAGING,
        },
    ),  # fmt: skip
    (
        "gpt2",
        {
            "stage": 3,
            "offload_param": "nvme",
            "offload_optimizer": "nvme",
            "grad_host_bytes": 0,
            "staging_bytes": STAGING,
        },
    ),  # fmt: skip
    (
        "gpt2",
        {
            "stage": 3,
            "offload_param": "nvme",
            "offload_optimizer": "nvme",
            "grad_host_bytes": 0,
            "map_param_file": False,
            "staging_bytes": STAGING,
        },
    ),  # fmt: skip
    (
        "gpt2",
        {
            "stage": 3,
            "dtype": "bf16",
            "offload_param": "nvme",
            "offload_optimizer": "nvme",
            "grad_host_bytes": 0,
            "staging_bytes": STAGING,
        },
    ),  # fmt: skip
    ("gpt2", {"stage": 3, "dtype": "bf16", "offload_param": "nvme", "offload_optimizer": "cpu"}),
    ("odd", {"stage": 3, "dtype": "bf16", "offload_param": "nvme", "offload_optimizer": "cpu"}),
    ("gpt2", {"stage": 2, "dtype": "bf16", "offload_optimizer": "nvme", "grad_host_bytes": 0}),
    (
        "gpt2",
        {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "grad_dtype": "bf16"}
        | {"grad_host_bytes": 0},
    ),
]
TIERS = ("offload_param", "offload_optimizer")


def allocated_vs_planned(rank, world, nvme_root, cases):
    """Per case: what the engine allocated over two steps, and what the estimate plans."""
    from harness import batches, build, loss_of

    import zerotune
    from zerotune.estimate import estimate
    from zerotune.sharding.buffers import pool_buffers
    from zerotune.sharding.plan import plan_swap, plan_units

    out = []
    for model_name, config in cases:
        config = dict(config)
        if "nvme" in (config.get("offload_param"), config.get("offload_optimizer")):
            config["nvme_path"] = nvme_root
        cfg = zerotune.ZeroConfig.from_dict(config)
        # The estimate, as `zerotune estimate` makes it (from the model before shard()).
        plan = estimate(
            build(model_name),
            world_size=world,
            dtype=cfg.dtype,
            config={
                k: v for k, v in config.items() if k not in ("stage", "dtype", "nvme_path", *TIERS)
            },
            device="cpu",
            gpu_memory=None,
        )
        detail = plan.option(cfg.stage, cfg.offload_param, cfg.offload_optimizer).detail
        units = plan_units(build(model_name), cfg, world)
        keys, _, _ = pool_buffers(units, cfg, world, plan_swap(units, cfg, world), "cpu")

        model = build(model_name)
        engine = zerotune.shard(model, cfg)
        opt = zerotune.ZeroAdamW(engine, lr=1e-3)
        for ids in batches(model_name, 2):
            loss_of(engine, ids[rank::world]).backward()
            opt.step()
            opt.zero_grad()
        cache = engine.pool.gather_cache
        out.append(
            {
                "engine": {
                    "pool": sorted(
                        (numel, dtype.itemsize, n)
                        for (numel, dtype), n in engine.pool.most_in_use.items()
                    ),
                    "gathered": engine.pool.gathered.peak,
                    "gather_cache": cache.keep_bytes if cache is not None else 0,
                    "staging": engine.staging.allocated if engine.staging is not None else 0,
                },
                "estimate": {
                    "pool": sorted((numel, size, n) for (numel, size, _), n in keys.items()),
                    "gathered": detail.get("gathered", {}).get("device", 0),
                    "gather_cache": detail.get("gather_cache", {}).get("host", 0),
                    "staging": detail.get("staging", {}).get("host", 0),
                },
            }
        )
        engine.close()
    return out


# World 1 (in-process) and 2 (reduce-scatters, the shard-sized buffers).
@pytest.mark.parametrize("world", [1, 2])
def test_the_estimates_buffers_are_the_ones_the_engine_allocates(world, tmp_path):
    """For each case: the reduce pool's buffers (per size, the most in use at once, from
    which the estimate's ``pool`` and ``pool_late`` lines are summed), the gathered
    parameters' peak (with prefetch), the gather cache's budget and the NVMe staging slots
    are the estimate's, exactly."""
    results = run_world(world, allocated_vs_planned, str(tmp_path), SIZING_CASES)
    for rank, per_case in enumerate(results):
        for (model_name, config), r in zip(SIZING_CASES, per_case):
            where = f"world={world} rank={rank} {model_name} {config}"
            engine, planned = _tuples(r["engine"]), _tuples(r["estimate"])
            for line in engine:
                assert engine[line] == planned[line], (where, line, engine[line], planned[line])
    # The cases exercise every line: pool buffers, gathers with and without the cache, staging.
    lines = [r["engine"] for per_case in results for r in per_case]
    assert all(any(e[line] for e in lines) for line in ("pool", "gathered", "gather_cache"))
    assert any(e["staging"] for e in lines)


def _tuples(lines: dict) -> dict:
    """The pool's (elements, itemsize, count) rows as tuples (rank processes send lists)."""
    return {k: [tuple(x) for x in v] if k == "pool" else v for k, v in lines.items()}
