"""pytest plugin of ``benchmarks/trainer_tests.py``: transformers' Trainer tests on ZeroTrainer.

Loaded with ``-p _zero_swap`` (``benchmarks/`` on ``PYTHONPATH``), before any test module is
imported. With ``ZEROTUNE_SWAP_STAGE`` set (1, 2 or 3) it replaces ``transformers.Trainer`` and
``transformers.TrainingArguments`` (the names ``from transformers import Trainer`` finds) with
ZeroTrainer and a ZeroTrainingArguments subclass whose ``zero_stage`` defaults to that stage.
zerotune itself is imported first, so it keeps the real classes (``transformers.trainer.Trainer``
is never touched). Without ``ZEROTUNE_SWAP_STAGE`` nothing is swapped (the plain run).

In both runs it appends one JSON line per test to ``ZEROTUNE_SWAP_RECORD`` as soon as the test
ends (so a run killed by a timeout keeps what finished): the outcome, the first line of the
error and the frame it was raised in, and how many trainers the test built: ``zero`` (ZeroTrainer
constructions), ``plain`` (Trainer constructions that were not ZeroTrainer: in a swapped run, a
test that reached the real Trainer past the swap), ``args`` (TrainingArguments built) and the
ZeRO stages the engines were built with.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback

import pytest

_STAGE = os.environ.get("ZEROTUNE_SWAP_STAGE") or None
_RECORD = os.environ.get("ZEROTUNE_SWAP_RECORD")

_counts: dict = {}
_results: dict[str, dict] = {}


def _reset() -> None:
    _counts.clear()
    _counts.update(zero=0, plain=0, args=0, stages=set())


_reset()


def _install() -> None:
    import transformers.trainer as hf_trainer
    import transformers.training_args as hf_args

    real_trainer_init = hf_trainer.Trainer.__init__
    real_args_post_init = hf_args.TrainingArguments.__post_init__

    def trainer_init(self, *args, **kwargs):
        if _STAGE is None or not isinstance(self, _ZeroTrainer):
            _counts["plain"] += 1
        return real_trainer_init(self, *args, **kwargs)

    def args_post_init(self, *args, **kwargs):
        _counts["args"] += 1
        return real_args_post_init(self, *args, **kwargs)

    hf_trainer.Trainer.__init__ = trainer_init
    hf_args.TrainingArguments.__post_init__ = args_post_init

    if _STAGE is None:
        return
    stage = int(_STAGE)

    # zerotune first: its modules bind the real Trainer / TrainingArguments.
    from zerotune.hf import ZeroTrainer as _ZT
    from zerotune.hf import ZeroTrainingArguments as _ZTA

    global _ZeroTrainer
    _ZeroTrainer = _ZT

    @dataclasses.dataclass
    class ZeroTrainingArguments(_ZTA):
        zero_stage: int | None = dataclasses.field(
            default=stage, metadata={"help": "ZeRO stage (default set by _zero_swap)."}
        )

    class ZeroTrainer(_ZT):
        def __init__(self, *args, **kwargs):
            _counts["zero"] += 1
            super().__init__(*args, **kwargs)
            engine = getattr(self, "engine", None)
            if engine is not None:
                _counts["stages"].add(engine.config.stage)

    for cls in (ZeroTrainingArguments, ZeroTrainer):
        # Reachable by name (pickle finds classes through their module): this module's.
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
        globals()[cls.__name__] = cls
    _swapped.update(Trainer=ZeroTrainer, TrainingArguments=ZeroTrainingArguments)
    _apply()


def _apply() -> None:
    """Set the swapped names on the ``transformers`` module now in ``sys.modules``: importing
    ``transformers.trainer`` the first time replaces that lazy module object with a new one,
    so the names are set again before each test module is collected and each test runs."""
    module = sys.modules["transformers"]
    for name, cls in _swapped.items():
        if module.__dict__.get(name) is not cls:
            setattr(module, name, cls)


_ZeroTrainer: type = type(None)
_swapped: dict[str, type] = {}
_install()


def pytest_collectstart(collector):
    _apply()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _apply()
    _reset()
    _results[item.nodeid] = {"outcome": "passed", "error": None, "where": None}
    yield
    rec = _results.pop(item.nodeid)
    rec.update(
        test=item.nodeid,
        zero=_counts["zero"],
        plain=_counts["plain"],
        args=_counts["args"],
        stages=sorted(_counts["stages"]),
    )
    if _RECORD:
        with open(_RECORD, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _where(excinfo) -> str | None:
    """The innermost frame in zerotune if there is one, else the innermost frame."""
    frames = traceback.extract_tb(excinfo.tb)
    if not frames:
        return None
    pick = next((fr for fr in reversed(frames) if "/zerotune/" in fr.filename), frames[-1])
    path = pick.filename
    for marker in ("/zerotune/", "/site-packages/", "/tests/"):
        if marker in path:
            path = marker.strip("/") + "/" + path.split(marker, 1)[1]
            break
    return f"{path}:{pick.lineno} ({pick.name})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    rec = _results.get(item.nodeid)
    if rec is None:
        return
    if hasattr(rep, "wasxfail"):
        rec["outcome"] = "xpassed" if rep.passed else "xfailed"
    elif rep.skipped and rec["outcome"] == "passed":
        rec["outcome"] = "skipped"
        rec["error"] = str(rep.longrepr[-1]) if isinstance(rep.longrepr, tuple) else None
    elif rep.failed and rec["outcome"] != "failed":
        rec["outcome"] = "failed"
        if call.excinfo is not None:
            lines = call.excinfo.exconly().strip().splitlines()
            rec["error"] = (lines[0] if lines else call.excinfo.typename)[:300]
            rec["where"] = _where(call.excinfo)
        if call.when != "call":
            rec["phase"] = call.when
