"""zerotune estimate: the engine's own numbers, the ZeRO papers' tables, the CLI."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
from conftest import run_together, run_world

from zerotune.estimate import engine_bytes, estimate
from zerotune.sharding.plan import plan_units

# ------------------------------------------------------------ estimate == real engines
# (model, config); nvme_path is filled in per test.
ENGINE_CASES = [
    ("gpt2", {"stage": 3}),
    ("gpt2", {"stage": 3, "dtype": "bf16", "persistence_threshold": 5000}),
    ("gpt2", {"stage": 1, "dtype": "bf16", "grad_dtype": "bf16"}),
    ("gpt2_frozen", {"stage": 2, "offload_optimizer": "cpu"}),
    ("odd", {"stage": 3, "dtype": "bf16", "offload_param": "cpu", "offload_optimizer": "cpu"}),
    (
        "gpt2",
        {
            "stage": 3,
            "offload_param": "nvme",
            "offload_optimizer": "nvme",
            "grad_host_bytes": 0,
            "staging_bytes": 3 * 16 * 4096 * 3,
        },
    ),
    ("odd", {"stage": 3, "dtype": "bf16", "offload_param": "nvme", "offload_optimizer": "cpu"}),
    ("gpt2", {"stage": 2, "dtype": "bf16", "offload_optimizer": "nvme"}),
]
COMPARED = ("params", "master", "grads", "full_grads", "optimizer", "staging", "nvme")


def _flat(kinds: dict) -> dict:
    out = {k: sum(v.values()) for k, v in kinds.items() if k in COMPARED}
    out["padding_elements"] = kinds["padding_elements"]["count"]
    return out


def engine_vs_plan(rank, world, nvme_root, cases):
    from harness import batches, build, loss_of

    import zerotune

    out = []
    for model_name, config in cases:
        config = dict(config)
        if "nvme" in (config.get("offload_param"), config.get("offload_optimizer")):
            config["nvme_path"] = nvme_root
        cfg = zerotune.ZeroConfig.from_dict(config)
        model = build(model_name)
        planned = plan_units(model, cfg, world)  # before shard(): shapes are still whole
        engine = zerotune.shard(model, cfg)
        opt = zerotune.ZeroAdamW(engine, lr=1e-3)
        ids = batches(model_name, 1)[0][rank::world]
        loss_of(engine, ids).backward()
        opt.step()
        report = engine.memory_report()
        engine.close()
        units = [
            (u.name, u.numel, u.padded_numel, u.shard_numel, u.persistent, u.trainable)
            for u in engine.units
        ]
        expected = _flat(engine_bytes(planned, cfg, world, rank, device=engine.device.type))
        out.append(
            {
                "units": units,
                "planned": [
                    (p.name, p.numel, p.padded, p.shard, p.persistent, p.trainable) for p in planned
                ],
                "deps": [[d.index for d in u.deps] for u in engine.units],
                "planned_deps": [list(p.deps) for p in planned],
                "report": {k: report.get(k, 0) for k in expected},
                "expected": expected,
            }
        )
    return out


# World 1 (no collectives, in-process) and 3 (uneven padding, every rank checked).
@pytest.mark.parametrize("world", [1, 3])
def test_plan_and_bytes_equal_the_engine(world, tmp_path):
    results = run_world(world, engine_vs_plan, str(tmp_path), ENGINE_CASES)
    for rank, per_case in enumerate(results):
        for (model_name, config), r in zip(ENGINE_CASES, per_case):
            where = f"world={world} rank={rank} {model_name} {config}"
            assert [tuple(u) for u in r["units"]] == [tuple(p) for p in r["planned"]], where
            assert r["deps"] == r["planned_deps"], where
            assert r["report"] == r["expected"], where


# ------------------------------------------------------------------ the ZeRO papers
# ZeRO (Rajbhandari et al., 2019), Table 1: model-state memory per device in GB (1e9 bytes)
# for mixed-precision Adam (2 + 2 + K bytes per parameter, K = 12) at data-parallel degree
# N_d: P_os = 4*Psi + K*Psi/N_d, P_os+g = 2*Psi + (2+K)*Psi/N_d, P_os+g+p = (4+K)*Psi/N_d.
# Values written to three significant digits, as the paper prints them.
TABLE_1 = {
    7.5e9: {
        1: ("120", "120", "120"),
        4: ("52.5", "41.3", "30.0"),
        16: ("35.6", "21.6", "7.50"),
        64: ("31.4", "16.6", "1.88"),
        256: ("30.4", "15.4", "0.469"),
        1024: ("30.1", "15.1", "0.117"),
    },
    128e9: {
        1: ("2048", "2048", "2048"),
        4: ("896", "704", "512"),
        16: ("608", "368", "128"),
        64: ("536", "284", "32.0"),
        256: ("518", "263", "8.00"),
        1024: ("514", "258", "2.00"),
    },
    1e12: {
        1: ("16000", "16000", "16000"),
        4: ("7000", "5500", "4000"),
        16: ("4750", "2875", "1000"),
        64: ("4188", "2219", "250"),
        256: ("4047", "2055", "62.5"),
        1024: ("4012", "2014", "15.6"),
    },
}


def _within_rounding(value: float, printed: str) -> bool:
    """``value`` rounds to ``printed`` at the printed precision (half a unit of the last
    digit, with a hair for float error)."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(value - float(printed)) <= 0.5 * 10**-decimals * (1 + 1e-9)


@pytest.mark.parametrize("psi", list(TABLE_1))
def test_zero_paper_table_1(psi):
    for nd, printed in TABLE_1[psi].items():
        plan = estimate(params=psi, world_size=nd, dtype="bf16", grad_dtype="bf16", gpu_memory=None)
        pos, posg, posgp = (plan.option(s) for s in (1, 2, 3))
        assert _within_rounding(posg.model_states / 1e9, printed[1]), (psi, nd, posg.model_states)
        assert _within_rounding(posgp.model_states / 1e9, printed[2]), (psi, nd)
        # Stage 1: the paper's P_os holds whole 16-bit gradients; zerotune's stage 1 also
        # keeps the (reduced) gradient shard between steps, 2*Psi/N_d more.
        shard = pos.detail["grads"]["device"]
        assert shard == 2 * math.ceil(psi / nd)
        assert _within_rounding((pos.model_states - shard) / 1e9, printed[0]), (psi, nd)
        # Where the bytes are: everything on the device, nothing on host or NVMe.
        for o in (pos, posg, posgp):
            assert o.per_rank("host") == o.per_rank("nvme") == 0


GPT_LIKE = [
    # (name, hidden, layers, heads, vocab, positions)
    ("gpt2-xl", 1600, 48, 25, 50257, 1024),
    ("gpt2-large", 1280, 36, 20, 50257, 1024),
    ("wide", 4096, 8, 32, 32000, 2048),
]


@pytest.mark.parametrize("name,hidden,layers,heads,vocab,positions", GPT_LIKE)
def test_zero_infinity_20_bytes_per_parameter(name, hidden, layers, heads, vocab, positions):
    """ZeRO-Infinity (Rajbhandari et al., 2021), Sec. 3: model states take 20 bytes per
    parameter (fp16 parameters and gradients, fp32 master, momentum, variance and gradients)
    and a GPT-like model has about 12 * layers * hidden^2 parameters."""
    from transformers import AutoModelForCausalLM, GPT2Config

    cfg = GPT2Config(
        n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab, n_positions=positions
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    plan = estimate(model, dtype="bf16", grad_dtype="fp32", gpu_memory=None)
    psi = plan.parameters
    blocks = 12 * layers * hidden**2
    embedding_share = (vocab + positions) * hidden + 13 * layers * hidden + 2 * hidden
    assert blocks <= psi <= blocks + embedding_share
    # Stage 1 at one rank is the paper's layout: 2 + 2 + 16 bytes per parameter.
    stage1 = plan.option(1).model_states
    assert stage1 == 20 * psi
    assert abs(stage1 / (20 * blocks) - 1) <= embedding_share / blocks
    # Stage 3 never holds a whole 16-bit gradient between steps: 18 bytes per parameter.
    assert plan.option(3).model_states == 18 * psi


# ------------------------------------------------------------------------ activations
def test_megatron_activation_formula():
    """Korthikanti et al. (2022): a GPT layer keeps s*b*h*(34 + 5*a*s/h) bytes in 16-bit
    (fused GeLU, dropout, attention that materializes the scores)."""
    from zerotune.estimate import ModelShape, activation_bytes

    for s, b, h, a in [(2048, 1, 4096, 32), (1024, 4, 1600, 25), (512, 2, 768, 12)]:
        shape = ModelShape(
            layers=10,
            hidden=h,
            heads=a,
            vocab=50257,
            intermediate=4 * h,
            kv_heads=a,
            mlp_factor=2,
            dropout=True,
            attention_dropout=True,
            attention="eager",
        )
        act = activation_bytes(shape, s, b, torch.bfloat16)
        assert act["layer"] * h == s * b * h * (34 * h + 5 * a * s)
        ckpt = activation_bytes(shape, s, b, torch.bfloat16, checkpointing=True)
        assert ckpt["held"] < act["held"] / 10  # only the layers' inputs
        assert ckpt["total"] >= ckpt["held"] + act["layer"]  # plus one layer recomputed


def _saved_bytes(model, ids) -> int:
    """Bytes of the tensors autograd keeps for backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(seen.values())


@pytest.mark.parametrize(
    "arch,attention,dtype",
    [
        ("gpt2", "sdpa", torch.float32),
        ("gpt2", "eager", torch.bfloat16),
        ("llama", "sdpa", torch.float32),
        ("llama", "eager", torch.float32),
        ("llama", "sdpa", torch.bfloat16),
    ],
)
def test_activation_formula_matches_what_autograd_keeps(arch, attention, dtype):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    from zerotune.estimate import activation_bytes, model_shape

    s, b, vocab = 128, 2, 2048
    if arch == "gpt2":
        cfg = GPT2Config(n_layer=3, n_embd=128, n_head=4, vocab_size=vocab, n_positions=s)
    else:
        cfg = LlamaConfig(
            num_hidden_layers=3,
            hidden_size=128,
            intermediate_size=344,
            num_attention_heads=8,
            num_key_value_heads=4,  # grouped-query attention
            vocab_size=vocab,
            max_position_embeddings=s,
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention, dtype=dtype)
    model.train()
    saved = _saved_bytes(model, torch.randint(0, vocab, (b, s)))
    act = activation_bytes(model_shape(model), s, b, dtype, device="cpu")
    expected = act["held"] + s * b * vocab * 4  # plus the loss's fp32 log-probabilities
    assert abs(expected / saved - 1) < 0.05, (saved, expected)


# --------------------------------------------------------------- plan and recommendation
def test_recommends_the_weakest_option_that_fits():
    plan = estimate(
        params=7.5e9, world_size=1, gpu_memory="80GB", host_memory="512GB", nvme_space="2TB"
    )
    order = [(o.stage, o.offload_param, o.offload_optimizer) for o in plan.options]
    assert order[:3] == [(1, "none", "none"), (1, "none", "cpu"), (1, "none", "nvme")]
    assert order[-1] == (3, "nvme", "nvme") and len(order) == 15
    rec = plan.recommended
    assert (rec.stage, rec.offload_param, rec.offload_optimizer) == (1, "none", "cpu")
    assert all(not o.fits for o in plan.options[: plan.options.index(rec)])
    assert rec.flags() == "--stage 1 --offload cpu"
    usable = 80e9 * 0.9
    assert plan.option(1).per_gpu > usable >= rec.per_gpu
    # Less host memory: the optimizer state goes to NVMe instead.
    small_host = estimate(params=7.5e9, gpu_memory="80GB", host_memory="64GB", nvme_space="2TB")
    rec = small_host.recommended
    assert (rec.stage, rec.offload_optimizer) == (1, "nvme")
    assert rec.flags("/mnt/nvme") == "--stage 1 --offload nvme --nvme-path /mnt/nvme"
    # A small GPU and host: only parameters and optimizer both on NVMe fit (ZeRO-Infinity),
    # if the disk is large enough.
    tiny = dict(params=7.5e9, gpu_memory="1GB", host_memory="2GB")
    rec = estimate(**tiny, nvme_space="1TB").recommended
    assert (rec.stage, rec.offload_param, rec.offload_optimizer) == (3, "nvme", "nvme")
    assert estimate(**tiny, nvme_space="100GB").recommended is None
    # Gradients in bf16 have no finetune flag: the command takes a config file saying so.
    plan = estimate(params=7.5e9, gpu_memory="80GB", host_memory="512GB", grad_dtype="bf16")
    assert plan.config_file() == {
        "stage": 1, "offload_param": "none", "offload_optimizer": "cpu", "grad_dtype": "bf16"
    }  # fmt: skip
    assert " --stage 1 --config zerotune.yaml --bf16" in plan.command()
    assert "zerotune.yaml holding {stage: 1, offload_param: none, offload_optimizer: cpu, " \
        "grad_dtype: bf16}" in plan.format()  # fmt: skip


def test_more_ranks_need_less_per_gpu_and_padding_is_counted():
    one = estimate(params=1_000_003, world_size=1, gpu_memory=None)
    three = estimate(params=1_000_003, world_size=3, gpu_memory=None)
    assert three.padding_elements == 2  # 1,000,003 -> 1,000,005 = 3 * 333,335
    s3 = three.option(3)
    assert s3.detail["params"]["device"] == 333_335 * 2
    assert s3.model_states < one.option(3).model_states / 2.9


def test_staging_too_small_is_reported_per_option():
    plan = estimate(params=1e6, config={"staging_bytes": 1024}, gpu_memory=None)
    nvme = plan.option(3, "nvme", "nvme")
    assert nvme.error and "staging_bytes" in nvme.error and nvme.fits is False
    assert plan.option(3, "cpu", "cpu").error is None


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_embeddings_gradient_buffer_meets_no_activation_peak(tied):
    """With offload on a CPU the reduce pool gives back a size only one unit uses. A tied
    input embedding reduces its gradient as backward ends, when the activations are gone:
    its buffer is "pool_late", set against what they left, not added to their peak. An
    untied head reduces as backward starts: its buffer counts in full."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from zerotune.config import ZeroConfig
    from zerotune.estimate import _rows, activation_bytes, model_shape
    from zerotune.sharding.buffers import working_buffers
    from zerotune.sharding.plan import plan_swap

    cfg = GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=3000, n_positions=64)
    cfg.tie_word_embeddings = tied
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    config = ZeroConfig.from_dict(
        {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
         "nvme_path": "/nonexistent", "grad_host_bytes": 0}
    )  # fmt: skip
    units = plan_units(model, config, 1)
    swap = plan_swap(units, config, 1)
    act = activation_bytes(model_shape(model), 64, 4, torch.float32, device="cpu")
    work = working_buffers(units, config, 1, swap, device="cpu", act_total=act["total"])
    buffers = _rows(units, config, 1, 0, swap, act, "cpu")[0]["buffers"]["host"]
    every = sum(n for kind in work.values() for n in kind.values())
    wte = next(u for u in units if u.name.endswith("wte"))
    head = next(u for u in units if u.name == "lm_head")
    if tied:
        # The embedding's gradient buffer (the largest one-off size) is late, and the
        # activations leave room for all of it by then: the row has none of it.
        assert work["pool_late"]["device"] > wte.padded * 4 // 2
        assert act["total"] - act["end"] > work["pool_late"]["device"]
        assert buffers <= every - work["pool_late"]["device"]
    else:
        assert "pool_late" not in work
        assert work["pool"]["device"] >= head.padded * 4  # the head's, kept in full
        assert buffers >= work["pool"]["device"]


def test_bad_input_raises_config_errors():
    from zerotune.config import ConfigError

    with pytest.raises(ConfigError, match="gpu_memory"):
        estimate(params=1e9, gpu_memory="lots")
    with pytest.raises(ConfigError, match="not both"):
        estimate()
    with pytest.raises(ConfigError, match="world_size"):
        estimate(params=1e9, world_size=0)
    with pytest.raises(ConfigError, match="params"):
        estimate(params=1.5)
    with pytest.raises(ConfigError, match=r"params: at most 1e\+13"):
        estimate(params=1e14)  # it used to run out of memory listing optimizer chunks
    with pytest.raises(ConfigError, match="gpus_per_node must be at least 1, got 0"):
        estimate(params=1e9, gpus_per_node=0)  # 0 was taken as "not given"
    for size in ("1e400", float("inf")):
        with pytest.raises(ConfigError, match="gpu_memory"):
            estimate(params=1e9, gpu_memory=size)  # an OverflowError before


def test_the_recommended_command_keeps_a_dtype_given_by_its_alias():
    for alias, flag in (("bfloat16", "--bf16"), ("float16", "--fp16"), ("bf16", "--bf16")):
        plan = estimate("tiny-gpt2", dtype=alias)
        assert flag in plan.command().split(), (alias, plan.command())


# ------------------------------------------------------------------- check_estimate
def test_check_estimate_warns_beyond_15_percent(tmp_path, caplog):
    from conftest import tiny_gpt2

    import zerotune
    from zerotune.estimate import check_estimate

    cfg = {
        "stage": 3,
        "offload_param": "nvme",
        "offload_optimizer": "nvme",
        "nvme_path": str(tmp_path),
    }
    engine = zerotune.shard(tiny_gpt2(), cfg)
    try:
        zerotune.ZeroAdamW(engine)
        nvme = engine.memory_report()["nvme"]
        plan = estimate(engine, config=cfg, dtype="fp32", device="cpu", seq_len=16, gpu_memory=None)
        host = plan.option(3, "nvme", "nvme").per_rank("host")
        args = dict(seq_len=16, min_bytes=0)
        with caplog.at_level("INFO", logger="zerotune.estimate"):
            assert check_estimate(engine, {"host": host, "nvme": nvme}, **args) == []
        assert "estimated" in caplog.text and "measured" in caplog.text
        assert check_estimate(engine, {"host": int(host * 1.1)}, **args) == []
        warnings = check_estimate(engine, {"device": int(host * 1.3), "nvme": nvme}, **args)
        assert len(warnings) == 1 and "host" in warnings[0] and "30%" in warnings[0]
        assert len(check_estimate(engine, {"nvme": nvme // 2}, **args)) == 1
        # Differences of a few MiB are not warned about by default (allocator noise).
        assert (
            check_estimate(engine, {"host": int(host * 1.3), "nvme": nvme // 2}, seq_len=16) == []
        )
        with pytest.raises(ValueError, match="tier"):
            check_estimate(engine, {"gpu": 1})
    finally:
        engine.close()


# ------------------------------------------------------------------------------ CLI
ESTIMATE = [sys.executable, "-c", "from zerotune.cli import main; main()", "estimate"]


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """The `zerotune estimate` processes of the tests below, all started at once: their
    results by name (a bad input's: its arguments joined)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    runs = {
        "json for a count": ["--params", "7.5e9", "--world-size", "64", "--host-memory", "512GB",
                             "--json"],
        "table for a model": ["--model", "gpt2-xl", "--world-size", "8", "--gpu-memory", "24GB",
                              "--host-memory", "256GB", "--seq-len", "1024",
                              "--activation-checkpointing",
                              "--nvme-path", str(tmp_path_factory.mktemp("nvme"))],
        **{" ".join(args): args for args, _ in REAL_PROCESS},
    }  # fmt: skip
    done = run_together(*([*ESTIMATE, *args] for args in runs.values()), env=env, timeout=120)
    return dict(zip(runs, done))


def test_cli_json_for_a_parameter_count(cli):
    out = cli["json for a count"]
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["parameters"] == 7_500_000_000 and data["world_size"] == 64
    assert len(data["options"]) == 15
    first = data["options"][0]
    assert first["stage"] == 1 and first["fits"] is True
    assert data["recommended"]["flags"] == "--stage 1 --offload none"
    # A bare count has no shape: no activations, so no block size or batch is assumed; the
    # plan's bf16 and 8 processes a node are.
    assert data["recommended"]["command"] == (
        "zerotune finetune --model MODEL --stage 1 --offload none --bf16 --nproc-per-node 8"
    )


def test_cli_table_for_a_model(cli):
    out = cli["table for a model"]
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "1,557,611,200 parameters" in text and "recommended:" in text
    # gpt2-xl is a preset, not in this (offline) cache: the command starts from random weights
    assert "zerotune finetune --model gpt2-xl --init random --stage" in text
    # The command runs the job the plan is for: its dtype, sequence length, micro-batch,
    # checkpointing and processes (finetune's own defaults are fp32, the context up to
    # 1024, a batch of 8, no checkpointing, one process).
    (command,) = [line.strip() for line in text.splitlines() if "zerotune finetune" in line]
    for flag in ("--bf16", "--block-size 1024", "--per_device_train_batch_size 1",
                 "--activation_checkpointing", "--nproc-per-node 8"):  # fmt: skip
        assert f" {flag}" in command, (flag, command)
    assert text.count("\n") > 15


BAD_INPUT = [
    (["--params", "abc"], "--params"),
    (["--params", "1e9", "--gpu-memory", "80QB"], "--gpu-memory"),
    (["--params", "1e9", "--world-size", "zero"], "--world-size"),
    (["--params", "1e9", "--world-size", "0"], "world_size"),
    (["--params", "1e9", "--host-memory", "-5GB"], "--host-memory"),
    (["--model", "no-such-model"], "no-such-model"),
    ([], "--model or --params"),
    (["--params", "1e9", "--bogus"], "--bogus"),
    (["--model", "tiny-gpt2", "--seq-len", "4096"], "exceeds the model's context length 128"),
    (["--params", "1e9", "--gpu-memory", "1e400"], "too large to be a size"),
    (["--params", "1e9", "--optim-state-bits", "4"], "--optim-state-bits"),
    (["--params", "1e9", "--device", "tpu"], "--device"),
    (["--params", "1e9", "--device", "cpu", "--gpu-memory", "24GB"], "is for --device gpu"),
]
REAL_PROCESS = [BAD_INPUT[1], BAD_INPUT[5]]


def _one_line_error(code: int, stdout: str, stderr: str, message: str) -> None:
    assert code == 2, (stdout, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], stderr
    assert lines[0].startswith("zerotune estimate: error:")
    assert "Traceback" not in stderr and stdout == ""


@pytest.mark.parametrize("args,message", BAD_INPUT)
def test_cli_bad_input_is_one_line_and_exit_code_2(args, message):
    from click.testing import CliRunner
    from zerotune.cli import main

    result = CliRunner().invoke(main, ["estimate", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit)
    _one_line_error(result.exit_code, result.stdout, result.stderr, message)


@pytest.mark.parametrize("args,message", REAL_PROCESS)
def test_cli_bad_input_in_a_real_process(cli, args, message):
    out = cli[" ".join(args)]
    _one_line_error(out.returncode, out.stdout, out.stderr, message)


def test_cli_plans_8bit_moments_and_bf16_gradient_shards():
    """A 7B plan (bf16 compute) with both tiers on NVMe: 18 bytes an element on disk with
    fp32 moments and gradient shards (parameters 2, master 4, moments 8, gradients 4), 10
    with 8-bit moments (and their absmax) and bf16 gradient shards; the recommended command
    asks for the 8-bit optimizer."""
    from click.testing import CliRunner
    from zerotune.cli import main

    def nvme_bytes(*extra):
        args = ["estimate", "--params", "7e9", "--gpu-memory", "none", "--json", *extra]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        plan = json.loads(result.stdout)
        option = next(
            o
            for o in plan["options"]
            if (o["stage"], o["offload_param"], o["offload_optimizer"]) == (3, "nvme", "nvme")
        )
        return plan, option["nvme_per_host"] / 7e9

    plan32, full = nvme_bytes()
    plan8, small = nvme_bytes("--optim-state-bits", "8", "--grad-dtype", "bf16")
    assert plan32["optim_state_bits"] == 32 and plan8["optim_state_bits"] == 8
    assert 18 <= full < 18.01
    assert 10 <= small < 10.05
    assert "--optim adamw_8bit" in plan8["recommended"]["command"]


def test_cli_takes_a_hub_id_from_the_local_cache(tmp_path):
    """A hub id whose config is in the Hugging Face cache (offline), as `accelerate
    estimate-memory` takes one; its command loads the weights (no --init random)."""
    from transformers import GPT2Config

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--zt-test--small"
    snapshot = repo / "snapshots" / revision
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128)
    config.save_pretrained(snapshot)
    (snapshot / "model.safetensors").write_bytes(b"")  # the weights' presence is enough here
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    out, absent = run_together(
        [*ESTIMATE, "--model", "zt-test/small", "--json", "--gpu-memory", "none"],
        [*ESTIMATE, "--model", "zt-test/absent"],
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)
    n = 1000 * 64 + 128 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64
    assert plan["parameters"] == n and plan["model"] == "zt-test/small"
    command = plan["recommended"]["command"]
    assert command.startswith("zerotune finetune --model zt-test/small --stage")
    assert "--init random" not in command
    assert absent.returncode == 2 and "hub id whose config is in the local" in absent.stderr
