"""``ZeroTrainingArguments``: ``TrainingArguments`` plus how zerotune shards and offloads.

Every field is also a command-line flag through ``HfArgumentParser`` (``--zero_stage 3``,
``--offload_param nvme``, ``--nvme_path /mnt/nvme``, ``--prefetch_bytes 64MiB``, ...).
``zero_config`` (a YAML/JSON path or a dict, see ``zerotune.ZeroConfig``) gives the base; the
fields set here override it. ``--bf16`` / ``--fp16`` choose the dtype the engine keeps the
parameters in (fp32 master weights stay on the optimizer side), not an autocast: accelerate's
mixed precision is switched off, and fp16 uses the engine's dynamic loss scaler.
"""

# No ``from __future__ import annotations``: HfArgumentParser reads the field types at run time.

import copy
import os
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..config import ConfigError, ZeroConfig, first_line
from .configs import read_zero_config_file

__all__ = ["ZeroTrainingArguments"]


# Optimizer names that ZeroAdamW implements (the Trainer's default is one of them).
_ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused")
# ZeroAdamW with 8-bit moments (optim_state_bits: 8, bitsandbytes' blockwise quantization).
_ADAMW_8BIT_NAMES = ("adamw_8bit", "adamw_bnb_8bit")
# Optimizers that reach for the whole model's parameters (GaLore's and APOLLO's projections,
# LOMO's updates inside backward): not over shards.
_WHOLE_MODEL_OPTIMIZERS = ("galore_", "apollo_", "lomo", "adalomo")
# Fields that map one to one onto ZeroConfig keys.
_CONFIG_FIELDS = {
    "zero_stage": "stage",
    "offload_param": "offload_param",
    "offload_optimizer": "offload_optimizer",
    "nvme_path": "nvme_path",
    "prefetch_bytes": "prefetch_bytes",
    "max_live_bytes": "max_live_bytes",
    "persistence_threshold": "persistence_threshold",
    "staging_bytes": "staging_bytes",
    "grad_host_bytes": "grad_host_bytes",
    "offload_activations": "offload_activations",
    "tile_linear_bytes": "tile_linear_bytes",
}


def _has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return accelerator.is_available()
    return torch.cuda.is_available()


@dataclass
class ZeroTrainingArguments(TrainingArguments):
    """``TrainingArguments`` for :class:`zerotune.hf.ZeroTrainer`.

    Unset zerotune fields (None) take their value from ``zero_config``, then from
    ``ZeroConfig``'s defaults (ZeRO-3, no offload). Sizes are bytes; strings such as
    ``"64MiB"`` work too.
    """

    zero_config: dict | str | None = field(
        default=None,
        metadata={"help": "zerotune config: a YAML/JSON file (see configs/zero3*.yaml) or a dict; "
                  "the zerotune flags below override it."},
    )  # fmt: skip
    zero_stage: int | None = field(
        default=None,
        metadata={"help": "ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also "
                  "parameters (default 3).", "choices": [1, 2, 3]},
    )  # fmt: skip
    offload_param: str | None = field(
        default=None,
        metadata={"help": "Where stage-3 parameter shards live between uses.",
                  "choices": ["none", "cpu", "nvme"]},
    )  # fmt: skip
    offload_optimizer: str | None = field(
        default=None,
        metadata={"help": "Where fp32 master weights, Adam moments and gradient shards live.",
                  "choices": ["none", "cpu", "nvme"]},
    )  # fmt: skip
    nvme_path: str | None = field(
        default=None, metadata={"help": "Folder for NVMe swap files (needed by nvme offload)."}
    )
    prefetch_bytes: int | str | None = field(
        default=None, metadata={"help": "Bytes of parameters gathered ahead of use (stage 3)."}
    )
    max_live_bytes: int | str | None = field(
        default=None, metadata={"help": "Bound on gathered parameter bytes held at once."}
    )
    persistence_threshold: int | str | None = field(
        default=None,
        metadata={"help": "Units of at most this many gathered bytes stay gathered (stage 3)."},
    )
    staging_bytes: int | str | None = field(
        default=None, metadata={"help": "Host staging buffers for NVMe transfers, in bytes."}
    )
    grad_host_bytes: int | str | None = field(
        default=None,
        metadata={"help": "With nvme optimizer offload: gradient shards stay in host memory "
                  "up to this many bytes."},
    )  # fmt: skip
    offload_activations: str | None = field(
        default=None,
        metadata={"help": "With --activation_checkpointing: where the saved inputs of "
                  "checkpointed blocks wait for backward.", "choices": ["none", "cpu", "nvme"]},
    )  # fmt: skip
    tile_linear_bytes: int | str | None = field(
        default=None,
        metadata={"help": "Split linear layers whose weight is larger than this into tiles "
                  "of at most this size, each its own sharding unit (0 = off)."},
    )  # fmt: skip
    save_dtype: str | None = field(
        default=None,
        metadata={"help": "dtype of the weights save_model writes (default: the training dtype).",
                  "choices": ["fp32", "bf16", "fp16"]},
    )  # fmt: skip
    gather_weights_on_save: bool | None = field(
        default=None,
        metadata={"help": "Also write a consolidated safetensors model (config, tokenizer) into "
                  "each checkpoint-N, so that from_pretrained loads it (default: when the "
                  "weights take at most 1 GiB in the save dtype)."},
    )  # fmt: skip
    weight_decay_all: bool = field(
        default=False,
        metadata={"help": "Apply --weight_decay to every parameter, biases and norms too (what "
                  "a DeepSpeed config's optimizer section does); by default the Trainer's "
                  "decay leaves those out."},
    )  # fmt: skip

    deepspeed_scheduler: dict | str | None = field(
        default=None,
        metadata={"help": "A DeepSpeed scheduler section as JSON (WarmupLR, WarmupDecayLR, "
                  "WarmupCosineLR, OneCycle, LRRangeTest) run instead of --lr_scheduler_type, "
                  "as DeepSpeed steps it; --deepspeed sets it from its config."},
    )  # fmt: skip
    deepspeed_optimizer: dict | str | None = field(
        default=None,
        metadata={"help": "A DeepSpeed optimizer section of a torch optimizer as JSON (e.g. "
                  '{"type": "SGD", "params": {"lr": "auto", "momentum": 0.9}}), over every '
                  "parameter in one group; --deepspeed sets it from its config."},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if isinstance(self.zero_config, ZeroConfig):
            self.zero_config = self.zero_config.to_dict()  # plain data: saved as JSON
        from .deepspeed import (
            LAUNCHER,
            check_deepspeed_optimizer,
            check_deepspeed_scheduler,
            launcher_deepspeed_config,
        )
        from .fsdp import launcher_fsdp_settings

        # The flag that gave the scheduler section, for the refusals of its schedule.
        self.deepspeed_scheduler_flag = "--deepspeed_scheduler"
        if self.deepspeed_scheduler:  # given alone; one from --deepspeed is checked there
            self.deepspeed_scheduler = check_deepspeed_scheduler(self.deepspeed_scheduler, self)
        if self.deepspeed_optimizer:
            self.deepspeed_optimizer = check_deepspeed_optimizer(self.deepspeed_optimizer, self)
            self.weight_decay_all = True  # one group, as DeepSpeed's
        self._launched_dtype()
        launched = launcher_deepspeed_config()  # always: the launchers' flags go
        launched_fsdp = launcher_fsdp_settings()
        if self.deepspeed:
            self._read_deepspeed(self.deepspeed, "--deepspeed")
        elif launched is not None and self.zero_config is None:
            self._read_deepspeed(launched, LAUNCHER)
        if self.fsdp:
            self._read_fsdp(self.fsdp, self.fsdp_config)
        elif launched_fsdp is not None and self.zero_config is None:
            self._read_fsdp(True, launched_fsdp)
        self._check_contradictions()
        self._check_values()
        # The engine holds the parameters in bf16/fp16 itself: hide the flags from the parent
        # (which would turn on accelerate's autocast and, for bf16 on CPU, refuse), then
        # restore them so the arguments still read as given.
        if not self.use_cpu and not _has_accelerator():
            # Without it, accelerate on a CPU-only host under torchrun trains each rank alone
            # (world size 1 in the Trainer) while torch.distributed spans all ranks.
            self.use_cpu = True
        bf16, fp16 = bool(self.bf16), bool(self.fp16)
        self.bf16 = self.fp16 = False
        try:
            super().__post_init__()
        finally:
            self.bf16, self.fp16 = bf16, fp16
        self.mixed_precision = "no"
        self._read_checkpoint_offload()
        self._zero = self._build_zero_config()

    def _read_checkpoint_offload(self) -> None:
        """transformers' own activation offload (``activation_checkpointing_kwargs``'s
        ``offload``: ``save_on_cpu`` hooks, which would sit inside the engine's and win) is
        ``offload_activations: cpu``, as FSDP's activation_checkpointing_offload is."""
        kwargs = getattr(self, "activation_checkpointing_kwargs", None)
        if not self.activation_checkpointing or not isinstance(kwargs, dict):
            return
        if not kwargs.get("offload"):
            return
        tier = self.offload_activations or self._raw_config().get("offload_activations")
        if tier not in (None, "none", "cpu"):
            raise ConfigError(
                f"activation_checkpointing_kwargs' offload (host memory) and offload_activations "
                f"{tier} both say where checkpoints go; keep one"
            )
        self.offload_activations = "cpu"
        kwargs = {k: v for k, v in kwargs.items() if k != "offload"} or None
        self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs = kwargs

    # ------------------------------------------------------------------ validation
    def _launched_dtype(self) -> None:
        """``accelerate launch --mixed_precision bf16`` (or fp16, its config's
        mixed_precision): the plain Trainer then trains under autocast; here it is --bf16
        (--fp16), the engine's dtype, unless a flag gives one."""
        launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        if launched == "fp8":
            raise ConfigError("accelerate launch's mixed_precision fp8 is not supported; use bf16")
        if launched in ("bf16", "fp16") and not (self.bf16 or self.fp16):
            setattr(self, launched, True)

    def _read_fsdp(self, fsdp, fsdp_config) -> None:
        """FSDP settings become the base zerotune config ([Note: FSDP settings] in fsdp.py);
        the parent never sees them (it would wrap the engine in FSDP)."""
        from .fsdp import zero_config_from_fsdp

        if self.zero_config is not None:
            raise ConfigError(
                "--fsdp and --zero_config (or --deepspeed) both give the sharding; keep one."
            )
        self.zero_config, trainer = zero_config_from_fsdp(fsdp, fsdp_config)
        if self.gather_weights_on_save is None:
            self.gather_weights_on_save = trainer.get("gather_weights_on_save")
        if trainer.get("activation_checkpointing"):
            # transformers 5.2x names it activation_checkpointing, earlier releases
            # gradient_checkpointing.
            old = not hasattr(self, "activation_checkpointing")
            setattr(self, "gradient_checkpointing" if old else "activation_checkpointing", True)
        self.fsdp, self.fsdp_config = None, None

    def _read_deepspeed(self, source, where: str) -> None:
        """A DeepSpeed config (``--deepspeed``, or the one accelerate launch passed) becomes the
        base zerotune config ([Note: DeepSpeed configs] in deepspeed.py); the parent never
        sees it (it would start DeepSpeed)."""
        from .deepspeed import read_deepspeed_config, zero_config_from_deepspeed

        if self.zero_config is not None:
            raise ConfigError(
                "--deepspeed and --zero_config both give the ZeRO configuration; keep one."
            )
        try:
            data = read_deepspeed_config(source)
            for section in ("scheduler", "optimizer"):
                if getattr(self, f"deepspeed_{section}") and data.get(section):
                    raise ConfigError(
                        f"{where} has its own {section} section and --deepspeed_{section} gives "
                        "one; keep one."
                    )
            self.zero_config, trainer = zero_config_from_deepspeed(data, self)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("--deepspeed", where, 1)) from None
        if "deepspeed_scheduler" in trainer:
            self.deepspeed_scheduler = trainer["deepspeed_scheduler"]
            self.deepspeed_scheduler_flag = where
        self.deepspeed_optimizer = trainer.get("deepspeed_optimizer", self.deepspeed_optimizer)
        if self.gather_weights_on_save is None:
            self.gather_weights_on_save = trainer.get("gather_weights_on_save")
        self.weight_decay_all = self.weight_decay_all or trainer.get("weight_decay_all", False)
        self.deepspeed = None

    def _check_contradictions(self) -> None:
        launched = os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower()
        if self.parallelism_config is not None or launched in ("true", "1"):
            raise ConfigError(
                "a parallelism config (accelerate's tensor, context or sequence parallelism) "
                "cannot be combined with ZeroTrainer: zerotune shards over data-parallel ranks "
                "only."
            )
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 cannot both be set; choose one training dtype.")
        self._check_optimizer()
        base = self._raw_config()
        offload = (
            self.offload_param or base.get("offload_param"),
            self.offload_optimizer or base.get("offload_optimizer"),
        )
        if "nvme" in offload and not self.nvme_path and not base.get("nvme_path"):
            raise ConfigError(
                "NVMe offload needs --nvme_path (a folder on a fast local disk for the swap files)."
            )

    @property
    def uses_zero_adamw(self) -> bool:
        """Whether ``--optim`` names AdamW, which ZeroTrainer runs as ZeroAdamW (the fused C++
        step, 8-bit states, NVMe streaming); any other runs through ZeroOptimizer."""
        return getattr(self.optim, "value", self.optim) in _ADAMW_NAMES + _ADAMW_8BIT_NAMES

    def _check_optimizer(self) -> None:
        """An ``--optim`` that cannot run here is refused in one sentence naming why."""
        optim = getattr(self.optim, "value", self.optim)
        if self.uses_zero_adamw:
            return
        if optim.startswith(_WHOLE_MODEL_OPTIMIZERS):
            raise ConfigError(
                f"--optim {optim} is not supported by ZeroTrainer: it hooks into the whole "
                "model's parameters (low-rank projections, or updates fused into backward), "
                "which zerotune keeps sharded; choose another --optim."
            )
        from transformers import Trainer

        try:
            Trainer.get_optimizer_cls_and_kwargs(self)
        except (ImportError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"--optim {optim} cannot run here: {first_line(exc)}") from None
        base = self._raw_config()
        if base.get("optim_state_bits", 32) != 32:
            raise ConfigError(
                f"--optim {optim} contradicts optim_state_bits={base['optim_state_bits']} in the "
                "zerotune config (8-bit Adam states); keep one of them."
            )

    def _check_values(self) -> None:
        """Values that would fail later (inside the first step, or as a traceback of the
        Trainer's data loader) or train silently wrong, refused here in one sentence."""
        if self.learning_rate < 0:
            raise ConfigError(f"--learning_rate must be >= 0, got {self.learning_rate}")
        if self.weight_decay < 0:
            raise ConfigError(f"--weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ConfigError(f"--{name} must be in [0, 1), got {value}")
        if not self.adam_epsilon > 0:
            raise ConfigError(
                f"--adam_epsilon must be > 0, got {self.adam_epsilon} (with 0, an element whose "
                "gradient and moments are zero becomes 0/0 = NaN)"
            )
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ConfigError(
                f"--max_grad_norm must be >= 0 (0 turns clipping off), got {self.max_grad_norm}"
            )
        for name in (
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
        ):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"--{name} must be at least 1, got {value}")
        if self.dataloader_num_workers < 0:
            raise ConfigError(
                f"--dataloader_num_workers must be >= 0, got {self.dataloader_num_workers}"
            )
        if self.dataloader_persistent_workers and self.dataloader_num_workers == 0:
            raise ConfigError(
                "--dataloader_persistent_workers needs --dataloader_num_workers of at least 1"
            )
        if self.torch_compile or self.torch_compile_mode or self.torch_compile_backend:
            from ..sharding.compiled import compile_problem

            problem = compile_problem(self.torch_compile_mode, self.torch_compile_backend)
            if problem is not None:
                raise ConfigError(f"--torch_compile: {problem}")
        if self.optim_args and self.uses_zero_adamw:
            raise ConfigError(
                "--optim_args is not read by ZeroAdamW; set --adam_beta1, --adam_beta2, "
                "--adam_epsilon and --weight_decay instead."
            )

    def _raw_config(self) -> dict[str, Any]:
        try:
            return self.zero_config_dict()
        except ConfigError:
            return {}  # reported by _build_zero_config with the file's own message

    def zero_config_dict(self) -> dict[str, Any]:
        """The raw mapping of ``zero_config`` (empty when unset)."""
        source = self.zero_config
        if source is None:
            return {}
        if isinstance(source, dict):
            return copy.deepcopy(source)
        return read_zero_config_file(source)

    def _build_zero_config(self) -> ZeroConfig:
        data = self.zero_config_dict()
        for name, key in _CONFIG_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                data[key] = value
        flag_dtype = "bf16" if self.bf16 else "fp16" if self.fp16 else None
        if flag_dtype is not None:
            if data.get("dtype") not in (None, flag_dtype):
                raise ConfigError(
                    f"--{flag_dtype} contradicts dtype={data['dtype']!r} in the zerotune config; "
                    "keep one of them."
                )
            data["dtype"] = flag_dtype
        optim = getattr(self.optim, "value", self.optim)
        if optim in _ADAMW_8BIT_NAMES:
            if data.get("optim_state_bits", 8) != 8:
                raise ConfigError(
                    f"--optim {optim} contradicts optim_state_bits={data['optim_state_bits']} in "
                    "the zerotune config; keep one of them."
                )
            data["optim_state_bits"] = 8
        # There is no DDP wrapper for --ddp_find_unused_parameters to reach: it sets the
        # engine's find_unused_parameters instead. Unset, it is on, as the Trainer's DDP has
        # it (DDP leaves it off with gradient checkpointing, which zerotune's walk goes
        # through: see [Note: find unused parameters] in sharding/grads.py for its limits).
        wanted = self.ddp_find_unused_parameters
        if wanted is not None:
            if data.get("find_unused_parameters", wanted) != wanted:
                raise ConfigError(
                    f"--ddp_find_unused_parameters {str(wanted).lower()} contradicts "
                    f"find_unused_parameters={data['find_unused_parameters']} in the zerotune "
                    "config; keep one of them."
                )
            data["find_unused_parameters"] = wanted
        data.setdefault("find_unused_parameters", True)
        try:
            return ZeroConfig.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"invalid zerotune configuration: {exc}") from None

    # -------------------------------------------------------------------- results
    @property
    def zero(self) -> ZeroConfig:
        """The engine configuration these arguments describe."""
        return self._zero

    @property
    def place_model_on_device(self) -> bool:
        # The engine places every shard on its tier; the Trainer must not move the model.
        return False
