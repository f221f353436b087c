"""zerotune env: versions from package metadata (no import noise from optional packages),
the optional extras named, the ops' state."""

from __future__ import annotations

import json
import os
import sys

from conftest import run_together


def test_env_reports_versions_without_optional_packages_noise():
    command = [sys.executable, "-c", "from zerotune.cli import main; main()", "env"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    text, out = run_together(command, [*command, "--json"], env=env, timeout=120)
    assert text.returncode == 0, text.stderr[-2000:]
    # bitsandbytes prints lines about its kernels when imported; env does not import it.
    assert text.stderr == "", text.stderr[-2000:]
    assert text.stdout.startswith("zerotune environment")
    versions = json.loads(out.stdout)["versions"]
    from importlib.metadata import version

    for name in ("transformers", "bitsandbytes", "matplotlib", "trl"):
        assert versions[name] == version(name), name  # the dev extras install all three
    assert set(versions) >= {"python", "torch", "datasets", "safetensors", "click", "zerotune"}


def test_a_missing_optional_package_names_its_extra(monkeypatch):
    import importlib.metadata as metadata

    from zerotune.cli import env as command

    real = metadata.version

    def version(name):
        if name == "bitsandbytes":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    versions = command._versions()
    assert versions["bitsandbytes"] == "not installed (optional: pip install zerotune[bnb])"
    assert versions["trl"] == real("trl")


def test_env_names_the_cpu_and_the_adam_prefetch_it_chose():
    """The CPU model and, once the adam op is loaded, the prefetch distance its kernel chose
    for this CPU's vendor ([Note: prefetch]): what a speed report needs to be read."""
    from pathlib import Path

    import pytest
    from zerotune.cli import env as command

    from zerotune import ops

    info = command.collect(build=True)["cpu"]
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")]
    if names:
        assert info["model"] == names[0]
    op = ops.load_op("adam")
    if op is None:
        pytest.skip("the adam op is not built here")
    assert info["adam_prefetch"] == op.prefetch_distance()
    vendor = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("vendor_id")), "")
    expected = {"GenuineIntel": 512, "AuthenticAMD": 128}.get(vendor, 0)
    assert info["adam_prefetch"] == expected, vendor
