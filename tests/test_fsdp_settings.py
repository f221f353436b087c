"""FSDP settings (--fsdp, --fsdp_config, accelerate launch with FSDP) read as zerotune's
config: the sharding stage, CPU offload and activation checkpointing they ask for, trained
like the plain Trainer; what has no counterpart refused in one line."""

from __future__ import annotations

import json
import os

import pytest
import torch
from trainer_cases import logged, plain_run, zero_run

import zerotune
from zerotune.hf import ZeroTrainingArguments


def test_fsdp_full_shard_with_offload_trains_like_the_plain_trainer(tmp_path):
    fsdp_config = {
        "fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"],
        "activation_checkpointing": True, "cpu_ram_efficient_loading": True,
        "state_dict_type": "SHARDED_STATE_DICT",
    }  # fmt: skip
    (tmp_path / "fsdp.json").write_text(json.dumps(fsdp_config))
    trainer = zero_run(str(tmp_path / "out"), fsdp="full_shard offload auto_wrap",
                       fsdp_config=str(tmp_path / "fsdp.json"))  # fmt: skip
    args, zero = trainer.args, trainer.args.zero
    assert (zero.stage, zero.offload_param, zero.offload_optimizer) == (3, "cpu", "cpu")
    assert args.gradient_checkpointing and not args.fsdp and not trainer.is_fsdp_enabled
    plain = plain_run(str(tmp_path / "plain"))
    torch.testing.assert_close(logged(trainer), logged(plain), rtol=1e-5, atol=0)
    trainer.close()


@pytest.mark.parametrize(
    "fsdp, fsdp_config, expected",
    [
        (True, {"reshard_after_forward": False}, (2, "none", "none")),
        (True, {"cpu_offload": True}, (3, "cpu", "cpu")),
        ("shard_grad_op offload", None, (2, "none", "cpu")),
        # FSDP1 and accelerate's spelling: a strategy name or number, offload_params.
        (True, {"fsdp_version": 1, "fsdp_sharding_strategy": "SHARD_GRAD_OP",
                "fsdp_offload_params": True}, (2, "none", "cpu")),
        (True, {"sharding_strategy": 1, "version": 1}, (3, "none", "none")),
        (True, {"reshard_after_forward": "full_shard", "version": 1}, (3, "none", "none")),
        # FSDP2 (the default) reads reshard_after_forward only, as transformers does.
        (True, {"sharding_strategy": "SHARD_GRAD_OP"}, (3, "none", "none")),
        (True, {"version": 2, "sharding_strategy": "HYBRID_SHARD",
                "reshard_after_forward": False}, (2, "none", "none")),
        ("FULL_SHARD", '{"cpu_offload": true}', (3, "cpu", "cpu")),  # inline JSON
    ],
)  # fmt: skip
def test_fsdp_settings_become_the_zero_config(fsdp, fsdp_config, expected):
    args = ZeroTrainingArguments(output_dir="unused", fsdp=fsdp, fsdp_config=fsdp_config)
    zero = args.zero
    assert (zero.stage, zero.offload_param, zero.offload_optimizer) == expected
    assert not args.fsdp and args.fsdp_config is None


@pytest.mark.parametrize(
    "fsdp, fsdp_config, message",
    [
        ("no_shard", None, "no_shard .plain data parallelism"),
        (True, {"version": 1, "sharding_strategy": "HYBRID_SHARD"}, "'HYBRID_SHARD' has no"),
        ("full_shard offload", {"cpu_offload": False}, "offload and --fsdp_config's cpu_off"),
        (True, {"activation_checkpointing_offload": True}, "needs activation_checkpointing"),
        ("full_shard offlaod", None, "unknown option 'offlaod' .did you mean 'offload'"),
        ("full_shard", {"reshard_after_forward": False}, "give different sharding strategies"),
        (True, {"xla": True}, "XLA's FSDP"),
        (True, {"activation_checkpoint": True}, "did you mean 'activation_checkpointing'"),
        (True, "/no/such/fsdp.json", "--fsdp_config: no such file"),
    ],
)
def test_fsdp_refusals(fsdp, fsdp_config, message):
    with pytest.raises(zerotune.ConfigError, match=message):
        ZeroTrainingArguments(output_dir="unused", fsdp=fsdp, fsdp_config=fsdp_config)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"}, (3, "cpu", "cpu")),
        ({"FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false"}, (2, "none", "none")),
        # As accelerate launch sets them for an FSDP1 yaml (the last two would look for an
        # accelerator device).
        ({"FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP",
          "FSDP_OFFLOAD_PARAMS": "true", "FSDP_SYNC_MODULE_STATES": "true",
          "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"},
         (2, "none", "cpu")),
    ],
)  # fmt: skip
def test_accelerate_launch_with_fsdp(monkeypatch, tmp_path, env, expected):
    """accelerate launch with an FSDP config: accelerate's plugin reads its variables, the
    settings become the zerotune config, and neither the Trainer nor accelerate wraps the
    engine in FSDP."""
    for key in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    trainer = zero_run(str(tmp_path / "out"), max_steps=2)
    zero = trainer.args.zero
    assert (zero.stage, zero.offload_param, zero.offload_optimizer) == expected
    assert "ACCELERATE_USE_FSDP" not in os.environ and not trainer.is_fsdp_enabled
    assert trainer.args.gather_weights_on_save is ("FSDP_STATE_DICT_TYPE" in env or None)
    assert trainer.state.global_step == 2
    trainer.close()


def test_fsdp_options_beyond_the_sharding(tmp_path):
    """Activation checkpointing offloaded to the CPU is zerotune's offload_activations; the
    state-dict type says whether saves gather the weights; FSDP's own knobs are ignored."""
    config = {"activation_checkpointing": True, "activation_checkpointing_offload": True,
              "state_dict_type": "SHARDED_STATE_DICT",
              "mixed_precision_policy": "bf16", "ignored_modules": [], "backward_prefetch_policy":
              "BACKWARD_PRE", "cpu_offload_pin_memory": True}  # fmt: skip
    args = ZeroTrainingArguments(output_dir="unused", fsdp="full_shard", fsdp_config=config)
    assert args.zero.offload_activations == "cpu" and args.activation_checkpointing
    assert args.gather_weights_on_save is False
    full = {"state_dict_type": "FULL_STATE_DICT"}
    assert ZeroTrainingArguments(
        output_dir="unused", fsdp=True, fsdp_config=full
    ).gather_weights_on_save
