"""Building the C++ ops: the per-user cache, the build lock, and the fallback when it fails."""

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import Started, start_for

from zerotune.ops import build as ops_build
from zerotune.ops import cpu_simd_level, load_op, op_status

ROOT = Path(__file__).resolve().parents[1]

# Child script: load the op, run one update, compare with torch.optim.AdamW, report as JSON.
CHILD = textwrap.dedent(
    """
    import json, logging, sys
    import torch

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))

    logging.getLogger("zerotune.ops").addHandler(Keep())
    logging.getLogger("zerotune.ops").setLevel(logging.INFO)

    from zerotune.ops import load_op, op_status
    from zerotune.optim.cpu_adam import adam_update, backend

    n = 1000
    torch.manual_seed(0)
    p = torch.randn(n)
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    m, v = torch.zeros(n), torch.zeros(n)
    for step in range(1, 4):
        g = torch.randn(n)
        ref.grad = g.clone()
        opt.step()
        adam_update(p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.1)
    load_op("adam")  # a second request must not warn again
    st = op_status("adam")
    print(json.dumps({
        "close": torch.allclose(p, ref.detach(), rtol=1e-6, atol=1e-7),
        "backend": backend(),
        "state": st.state,
        "reason": st.reason,
        "path": st.path,
        "records": records,
    }))
    """
)


def _child_command(cache: Path, **env_over: str) -> tuple[list[str], dict]:
    env = dict(os.environ)
    env.pop("ZEROTUNE_DISABLE_OPS", None)
    env["ZEROTUNE_CACHE"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(env_over)
    return [sys.executable, "-c", CHILD], dict(cwd=ROOT, env=env)


def _result(child: Started) -> dict:
    proc = child.result(timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", autouse=True)
def broken_compiler_child(request, tmp_path_factory):
    """The child of ``test_broken_compiler_falls_back_with_one_warning``, started with the
    module's first test (it needs no compiler time)."""
    command, popen = _child_command(tmp_path_factory.mktemp("broken"), CXX="/bin/false")
    child = start_for(request, "test_broken_compiler_falls_back_with_one_warning", command, **popen)
    yield child
    if child is not None:
        child.stop()


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    """Two processes start at once on an empty cache; returns the cache and their reports."""
    cache = tmp_path_factory.mktemp("zt_cache")
    command, popen = _child_command(cache)
    children = [Started(command, **popen) for _ in range(2)]
    return cache, [_result(c) for c in children]


def test_concurrent_build_both_succeed(built_cache):
    cache, reports = built_cache
    for rep in reports:
        assert rep["close"], rep
        assert rep["state"] == "loaded", rep
        assert rep["backend"].startswith("cpp-")
        assert rep["path"].startswith(str(cache))
        assert not [r for r in rep["records"] if r[0] == "WARNING"], rep["records"]
    assert reports[0]["path"] == reports[1]["path"]
    messages = [msg for rep in reports for _, msg in rep["records"]]
    assert sum("built zerotune op 'adam'" in msg for msg in messages) == 1, messages
    builds = [p for p in (cache / "ops").iterdir() if p.is_dir()]
    assert len(builds) == 1 and (builds[0] / "BUILD_OK").exists()


def test_status_of_a_cached_build(built_cache, monkeypatch):
    cache, reports = built_cache
    monkeypatch.setenv("ZEROTUNE_CACHE", str(cache))
    monkeypatch.setattr(ops_build, "_results", {})  # a fresh process, as far as ops know
    st = op_status("adam")
    assert st.state == "built" and st.path == reports[0]["path"]
    assert load_op("adam") is not None  # imported from the cache, no compiler involved
    assert op_status("adam").state == "loaded"


def test_status_not_built(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTUNE_CACHE", str(tmp_path))
    monkeypatch.setattr(ops_build, "_results", {})
    st = op_status("adam")
    assert st.state == "not built" and st.path.startswith(str(tmp_path))


def test_broken_compiler_falls_back_with_one_warning(broken_compiler_child):
    rep = _result(broken_compiler_child)
    assert rep["close"], rep
    assert rep["backend"] == "torch-fallback"
    assert rep["state"] == "fallback"
    assert "/bin/false" in rep["reason"]
    warnings = [msg for level, msg in rep["records"] if level == "WARNING"]
    assert len(warnings) == 1, rep["records"]
    assert "/bin/false" in warnings[0] and "Fix:" in warnings[0] and "g++" in warnings[0]


def test_missing_compiler_names_the_fix(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ZEROTUNE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setattr(ops_build, "_results", {})
    assert load_op("adam") is None
    assert load_op("adam") is None
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "no C++ compiler found" in warnings[0].message and "install g++" in warnings[0].message
    assert op_status("adam").state == "fallback"


def test_disable_env_forces_fallback(monkeypatch, caplog):
    monkeypatch.setenv("ZEROTUNE_DISABLE_OPS", "1")
    monkeypatch.setattr(ops_build, "_results", {})
    assert load_op("adam") is None
    st = op_status("adam")
    assert st.state == "fallback" and "ZEROTUNE_DISABLE_OPS" in st.reason
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_unknown_op_and_simd_level():
    with pytest.raises(ValueError, match="unknown op 'nope'; known ops: adam"):
        load_op("nope")
    level = cpu_simd_level()
    assert level in ("avx512", "avx2", "neon", "scalar")
    op = load_op("adam")
    if op is not None and level != "neon":
        assert op.simd_level() == level
