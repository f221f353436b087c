"""Every stage trains the same model as plain single-process AdamW (losses and weights)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_world
from harness import LR, MAX_NORM, STEPS, train_reference, train_zero

RTOL, ATOL = 1e-5, 1e-6
# Weights: Adam divides by sqrt(v), so rounding differences of the gradient sums (another
# reduction order at another world size) grow to a few 1e-6 absolute over 10 steps on a
# few elements; a wrong update (weight decay once too often: lr*wd*|w| per step) is
# several times larger than this bound after 10 steps.
WEIGHT_ATOL = 1e-5
# A parameter whose gradient is zero in exact arithmetic (GPT-2's attention key bias: softmax
# ignores a constant added to every score) gets rounding noise as gradient, which Adam turns
# into steps of about lr. Such parameters are held to what Adam can move them, lr per step;
# every other parameter to RTOL/ATOL.
NOISE_GRAD = 1e-6

CASES = [
    # (model, stage, accumulation micro-batches, use no_sync for the first micro-batch)
    ("gpt2", 1, 2, False),
    ("gpt2", 2, 2, True),
    ("gpt2", 3, 2, True),
    ("gpt2", 3, 1, False),
    ("odd", 1, 2, False),
    ("odd", 2, 2, False),
    ("odd", 3, 2, True),
    ("gpt2_ckpt", 3, 2, False),
]

_reference_cache: dict[str, dict] = {}


def reference(model_name: str) -> dict:
    if model_name not in _reference_cache:
        ref = train_reference(model_name)
        ref["weights"] = {k: v.numpy() for k, v in ref["weights"].items()}
        ref["grad_max"] = {k: v.numpy() for k, v in ref["grad_max"].items()}
        _reference_cache[model_name] = ref
    return _reference_cache[model_name]


def run_cases(rank, world, cases):
    return [
        train_zero(rank, world, model, {"stage": stage}, accum=accum, use_no_sync=no_sync)
        for model, stage, accum, no_sync in cases
    ]


def check(result: dict, ref: dict, label: str) -> None:
    np.testing.assert_allclose(result["losses"], ref["losses"], rtol=RTOL, atol=ATOL, err_msg=label)
    np.testing.assert_allclose(result["norms"], ref["norms"], rtol=RTOL, atol=ATOL, err_msg=label)
    assert sorted(result["weights"]) == sorted(ref["weights"]), label
    for name, w in ref["weights"].items():
        atol = np.where(ref["grad_max"][name] < NOISE_GRAD, LR * STEPS, WEIGHT_ATOL)
        bad = np.abs(result["weights"][name] - w) > atol + RTOL * np.abs(w)
        worst = np.abs(result["weights"][name] - w)[bad].max() if bad.any() else 0.0
        assert not bad.any(), (
            f"{label}: {name}: {bad.sum()} of {bad.size} elements differ, worst {worst:.3g} "
            f"at |w| {np.abs(w[bad]).min():.3g}, grad max {ref['grad_max'][name][bad].min():.3g}"
        )


@pytest.mark.parametrize("world", [1, 2, 3])
def test_all_stages_match_plain_adamw(world):
    results = run_world(world, run_cases, CASES)
    for case, res in zip(CASES, results[0]):
        model, stage, accum, no_sync = case
        ref = reference(model)
        # Clipping really clipped in this run (otherwise the test would not exercise it).
        assert max(ref["norms"]) > MAX_NORM
        check(res, ref, f"world={world} {case}")
    # Every rank saw the same global losses.
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert a["losses"] == b["losses"]


def run_bf16(rank, world):
    return train_zero(rank, world, "gpt2", {"stage": 3, "dtype": "bf16"}, accum=2)


def test_bf16_stays_within_bf16_tolerance_of_fp32():
    ref = reference("gpt2")
    res = run_world(2, run_bf16)[0]
    np.testing.assert_allclose(res["losses"], ref["losses"], rtol=2e-2)
    # The loss went down like the fp32 run's.
    assert res["losses"][-1] < res["losses"][0] - 0.1
    for name, w in ref["weights"].items():
        diff = np.abs(res["weights"][name] - w).max()
        assert diff < 5e-2, (name, diff)
