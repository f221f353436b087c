"""Strict configuration: sizes in bytes, unknown keys rejected with a suggestion."""

from __future__ import annotations

import re

import pytest

from zerotune import ConfigError, ZeroConfig, load_config
from zerotune.config import parse_bytes


def test_sizes_accept_bytes_and_units():
    assert parse_bytes(1024) == 1024
    assert parse_bytes("1KiB") == 1024
    assert parse_bytes("1.5 MB") == 1_500_000
    assert parse_bytes("2GiB") == 2 * 2**30
    assert ZeroConfig(prefetch_bytes="64MiB").prefetch_bytes == 64 * 2**20


@pytest.mark.parametrize("bad", ["12 parsecs", "-5", -1, 1.5, True, "MB"])
def test_bad_sizes_are_rejected(bad):
    with pytest.raises(ConfigError):
        parse_bytes(bad, name="prefetch_bytes")


def test_unknown_key_names_the_nearest_valid_one():
    with pytest.raises(ConfigError, match="did you mean 'prefetch_bytes'"):
        ZeroConfig.from_dict({"prefetch_byte": 10})
    with pytest.raises(ConfigError, match="unknown config key 'stagee' .did you mean 'stage'"):
        ZeroConfig(stagee=3)  # keyword arguments too (Python's own TypeError before)
    assert ZeroConfig(3).stage == 3


def test_impossible_values_are_explained():
    with pytest.raises(ConfigError, match="stage must be 1, 2 or 3"):
        ZeroConfig(stage=4)
    with pytest.raises(ConfigError, match="did you mean 'bf16'"):
        ZeroConfig(dtype="bf61")
    with pytest.raises(ConfigError, match="nvme_path is set"):
        ZeroConfig(nvme_path="/tmp/x")
    with pytest.raises(ConfigError, match="needs nvme_path"):
        ZeroConfig(offload_optimizer="nvme")
    with pytest.raises(ConfigError, match="needs stage 3"):
        ZeroConfig(stage=2, offload_param="cpu")
    with pytest.raises(ConfigError, match="did you mean 'nvme'"):
        ZeroConfig(offload_param="nvmee")


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("stage", True, "stage must be a whole number, got True"),
        ("stage", 3.0, "stage must be a whole number, got 3.0"),
        ("optim_state_bits", False, "optim_state_bits must be a whole number"),
        ("aio_threads", "4", "aio_threads must be a whole number"),
        ("map_param_file", 1, "map_param_file must be true or false, got 1"),
        ("find_unused_parameters", "yes", "find_unused_parameters must be true or false"),
        ("loss_scale_init", True, "loss_scale_init must be a number, got True"),
        ("dtype", 16, "dtype must be a string, got 16"),
        ("unit_modules", "GPT2Block", "unit_modules must be a list of names or null"),
        ("unit_modules", [1], "unit_modules must be a list of names"),
        ("prefetch_bytes", True, "prefetch_bytes: expected a size in bytes, got True"),
    ],
)
def test_booleans_and_numbers_are_not_each_other(key, value, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        ZeroConfig.from_dict({key: value})


def test_the_same_checks_hold_in_files(tmp_path):
    path = tmp_path / "z.yaml"
    path.write_text("stage: true\n")  # YAML's true, not the stage 1
    with pytest.raises(ConfigError, match="z.yaml: stage must be a whole number, got True"):
        load_config(path)
    path.write_text("loss_scale_init: 1024\nmap_param_file: false\n")
    config = load_config(path)
    assert config.loss_scale_init == 1024 and config.map_param_file is False


def test_yaml_and_json_files(tmp_path):
    y = tmp_path / "z.yaml"
    y.write_text("stage: 2\ndtype: bf16\nprefetch_bytes: 1MiB\n")
    cfg = load_config(y)
    assert (cfg.stage, cfg.dtype, cfg.prefetch_bytes) == (2, "bf16", 2**20)
    j = tmp_path / "z.json"
    j.write_text('{"stage": 1}')
    assert load_config(j).stage == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("stage: 3\nstagee: 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: unknown config key 'stagee'"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_round_trip():
    cfg = ZeroConfig(stage=2, dtype="bf16", persistence_threshold="4KiB")
    assert ZeroConfig.from_dict(cfg.to_dict()) == cfg
