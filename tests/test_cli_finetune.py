"""``zerotune finetune`` driven as a user would, away from the test's process: the embedded
default job, an exact resume, a local model folder with a jsonl dataset, two processes, and
bad input (one line, exit code 2, no output folder). A run gets a process of its own where
the process is what is tested (signals, the launcher, what a process prints, its
environment at import); the others share one (``cli``)."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from zerotune.hf.checkpoints import TRAINER_MARKER

COMMAND = [sys.executable, "-c", "from zerotune.cli import main; main()", "finetune"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Offline, with private HF / datasets caches and TMPDIR (to see temp folders cleaned)."""
    root = tmp_path_factory.mktemp("cli-env")
    (root / "tmp").mkdir()
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(root / "hf"),
        "TMPDIR": str(root / "tmp"),
        "TRANSFORMERS_VERBOSITY": "error",
        # Tiny models: one thread each (OpenMP threads spinning on a shared 2-core machine
        # cost more than they compute).
        "OMP_NUM_THREADS": "1",
    }


def finetune(env, *args, timeout=300, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [*COMMAND, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


# Most of a process is imports: runs that need no process of their own (no signal, no
# launcher, nothing printed beside the command's own lines) go to one process that runs
# zerotune's commands through click's runner, one after another, as the test asks: exit
# code, stdout and stderr of each (an exception that escaped is added to stderr as the
# traceback a process would print), on a pipe of their own.
RUNNER = r"""
import json, os, sys, traceback
from click.testing import CliRunner
from zerotune.cli import main

answers = os.fdopen(int(sys.argv[1]), "w")
for line in sys.stdin:
    args, cwd, env = json.loads(line)
    os.chdir(cwd)
    os.environ.update(env)
    r = CliRunner().invoke(main, args)
    err = r.stderr
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        err += "".join(traceback.format_exception(r.exception))
    answers.write(json.dumps([r.exit_code, r.stdout, err]) + "\n")
    answers.flush()
"""


class CliProcess:
    """One process that runs ``zerotune`` commands in turn (see RUNNER)."""

    def __init__(self, env):
        read, write = os.pipe()
        self.log = tempfile.TemporaryFile("w+")  # what the process prints outside a command
        self.proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(write)],
                                     stdin=subprocess.PIPE, stdout=self.log, stderr=self.log,
                                     text=True, env=env, pass_fds=(write,))  # fmt: skip
        os.close(write)
        self.answers = os.fdopen(read)

    def run(self, *args, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
        """``zerotune ARGS`` in the folder ``cwd`` (default: the test's), with ``env`` set
        in the process's environment from then on."""
        argv = [str(a) for a in args]
        self.proc.stdin.write(json.dumps([argv, str(cwd or os.getcwd()), env or {}]) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.answers], [], [], timeout)
        line = self.answers.readline() if ready else ""
        if not line:
            self.close()
            self.log.seek(0)
            pytest.fail(f"zerotune {' '.join(argv)}: no answer in {timeout} s\n"
                        + self.log.read()[-3000:])  # fmt: skip
        code, out, err = json.loads(line)
        return subprocess.CompletedProcess(argv, code, out, err)

    def finetune(self, *args, cwd=None, env=None, check=True) -> subprocess.CompletedProcess:
        proc = self.run("finetune", *args, cwd=cwd, env=env)
        if check:
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    def finetune_all(self, cases: dict, env=None) -> dict:
        """``finetune`` once per case (name -> arguments), in turn; name -> CompletedProcess."""
        return {name: self.finetune(*a, env=env, check=False) for name, a in cases.items()}

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.answers.close()


@pytest.fixture(scope="module")
def cli(env):
    """The module's process for runs that need none of their own (see RUNNER)."""
    runner = CliProcess(env)
    yield runner
    runner.close()


def finetune_in_new_process(env, cases: dict) -> dict:
    """``finetune`` once per case (name -> arguments), all in one new process with ``env``;
    name -> CompletedProcess."""
    runner = CliProcess(env)
    try:
        return runner.finetune_all(cases)
    finally:
        runner.close()


def finetune_each(env, cases: dict, timeout=300) -> dict:
    """Run ``finetune`` once per case (name -> arguments), all at once (2 cores: most of each
    is imports); name -> CompletedProcess."""
    procs = {
        name: subprocess.Popen([*COMMAND, *map(str, args)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
        for name, args in cases.items()
    }  # fmt: skip
    done = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=timeout)
        done[name] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    return done


def summary(folder: Path) -> dict:
    return json.loads((folder / "run_summary.json").read_text())


@pytest.fixture(scope="module")
def default_run(cli, tmp_path_factory):
    """The embedded default job; the first command of the module's process (the first
    test asks for it), so its elapsed time counts the imports, as a process of its own."""
    out = tmp_path_factory.mktemp("default") / "out"
    proc = cli.finetune("--output-dir", out)
    return out, proc


def test_default_job(default_run, env):
    """No arguments but the output folder: tiny GPT-2 from random weights, the shipped corpus,
    ZeRO-3 with NVMe offload to a temporary folder; the loss goes down, within 2 minutes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, proc = default_run
    s = summary(out)
    assert s["model"] == "tiny-gpt2" and s["init"] == "random" and s["world_size"] == 1
    zero = s["zero"]
    assert (zero["stage"], zero["offload_param"], zero["offload_optimizer"]) == (3, "nvme", "nvme")
    assert s["memory_rank0"]["nvme"] > 0 and s["global_step"] == 40
    losses = [loss for _, loss in s["losses"]]
    assert losses[-1] < losses[0] - 1.0, losses
    assert s["elapsed_s"] < 120
    assert "zerotune finetune: done" in proc.stdout and "tokens/s" in proc.stdout
    assert "1 thread(s) per process (OMP_NUM_THREADS)" in proc.stdout
    assert "building the model: 100%" in proc.stderr  # the engine's units, as they are placed
    # Tokens as trained: each epoch's last batch holds what is left of the blocks.
    blocks, batch = s["train_blocks"], 8
    per_epoch = -(-blocks // batch)
    epochs, rest = divmod(40, per_epoch)
    trained = epochs * blocks + min(rest * batch, blocks)
    assert s["tokens_this_run"] == trained * s["block_size"], (blocks, s["tokens_this_run"])
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-20", "checkpoint-40"]
    assert not list(Path(env["TMPDIR"]).glob("zerotune-nvme-*"))  # the temp swap folder is gone
    model = AutoModelForCausalLM.from_pretrained(out)
    # The last checkpoint holds the same weights, loadable as they are (a small model).
    last = AutoModelForCausalLM.from_pretrained(out / "checkpoint-40").state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(last[name], value), name
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("The engine cuts a model into units", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert float(loss) < losses[0]  # the saved weights are the trained ones


def test_a_run_the_memory_plan_says_will_not_fit_is_refused_before_loading(env, tmp_path):
    """gpt2 at the defaults (8 x 1024 tokens, fp32) needs ~30 GiB on a CPU: refused on a
    16 GiB host, naming what fits; the embedded default job on a 20 MiB host too, and run
    anyway with --no-memory-check. That run also starts on a machine whose C++ ops are not
    built: it says it builds them first (the compiler is /bin/false here, so the build
    fails at once and the PyTorch fallback trains)."""
    cases = {
        "gpt2": ["--model", "gpt2", "--init", "random"],
        "default": [],
        "unchecked": ["--no-memory-check", "--max_steps", "1", "--save_strategy", "no"],
    }
    runs = {n: ["--output-dir", tmp_path / n, *a] for n, a in cases.items()}
    # One process of its own (its C++ ops not built yet): the gpt2 refusal loads no op.
    fresh = CliProcess({**env, "ZEROTUNE_CACHE": str(tmp_path / "ops"), "CXX": "/bin/false"})
    try:
        done = fresh.finetune_all({"gpt2": runs.pop("gpt2")}, env={"ZEROTUNE_HOST_MEMORY": "16GiB"})
        done.update(fresh.finetune_all(runs, env={"ZEROTUNE_HOST_MEMORY": "20MiB"}))
    finally:
        fresh.close()
    gpt2 = done["gpt2"].stderr.strip().splitlines()
    assert done["gpt2"].returncode == 2 and len(gpt2) == 1, gpt2
    assert "micro-batch 8 x 1024 tokens: per host: needs 30.00 GiB, usable 14.40 GiB" in gpt2[0]
    assert "these would fit: --per_device_train_batch_size 1 --activation_checkpointing" in gpt2[0]
    assert "--no-memory-check runs it anyway" in gpt2[0]
    assert done["default"].returncode == 2 and "usable 18.0 MiB" in done["default"].stderr
    assert not (tmp_path / "gpt2").exists() and not (tmp_path / "default").exists()
    unchecked = done["unchecked"]
    assert unchecked.returncode == 0, unchecked.stderr[-2000:]
    assert summary(tmp_path / "unchecked")["global_step"] == 1
    building = "zerotune finetune: building the C++ ops (first run only, about a minute)"
    assert building in unchecked.stdout


def test_first_run_says_it_builds_the_ops(monkeypatch, capsys):
    """A machine whose C++ ops are not built yet hears why the first step waits."""
    from zerotune.cli import finetune as command

    import zerotune.ops.build as build

    built = []
    monkeypatch.setattr(build, "op_status", lambda name: build.OpStatus(name, "not built"))
    monkeypatch.setattr(build, "build_all", lambda: built.append(True))
    command._build_ops_once()
    assert built == [True]
    assert "building the C++ ops (first run only, about a minute)" in capsys.readouterr().out
    monkeypatch.setattr(build, "op_status", lambda name: build.OpStatus(name, "built"))
    command._build_ops_once()
    assert built == [True] and capsys.readouterr().out == ""


def test_optional_packages_missing_say_which_extra_brings_them(monkeypatch, tmp_path, capsys):
    from zerotune.cli import finetune as command

    from zerotune.config import ConfigError
    from zerotune.hf.finetune import plot_losses
    from zerotune.optim.quant8 import require_bitsandbytes

    for name in ("bitsandbytes", "bitsandbytes.functional", "matplotlib"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    with pytest.raises(ConfigError, match=r"pip install zerotune\[bnb\]"):
        require_bitsandbytes()
    assert plot_losses(tmp_path / "loss.png", [(1, 2.0)], [], "run", command._say) is None
    assert "no loss curve is drawn (pip install zerotune[plot])" in capsys.readouterr().err
    assert not (tmp_path / "loss.png").exists()


def test_threads_are_the_cpus_shared_out(monkeypatch, capsys):
    from zerotune.cli import finetune as command

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert command._threads_per_process(2) == 4
    assert "4 thread(s) per process (8 CPUs shared by 2 process(es)" in capsys.readouterr().out
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert command._threads_per_process(2) == 3


def test_resume_continues_with_the_same_losses(default_run, cli, tmp_path):
    """--resume from a copy of the default run's step-20 checkpoint logs its losses of steps
    25-40 again."""
    out, _ = default_run
    again = tmp_path / "again"
    again.mkdir()
    shutil.copytree(out / "checkpoint-20", again / "checkpoint-20")
    cli.finetune("--output-dir", again, "--resume")
    s = summary(again)
    assert s["global_step"] == 40 and s["steps_this_run"] == 20
    expected = dict((step, loss) for step, loss in summary(out)["losses"] if step > 20)
    got = {step: loss for step, loss in s["losses"] if step > 20}  # also holds the history
    assert sorted(got) == sorted(expected)
    torch.testing.assert_close([got[k] for k in sorted(got)], [expected[k] for k in sorted(got)],
                               rtol=1e-5, atol=0)  # fmt: skip


def test_resume_reuses_the_runs_own_options_and_refuses_others(cli, tmp_path):
    """--resume continues the run as it was started: the dataset, block size and dtype it
    is not given come from the run's record (they used to fall back to the defaults: another
    corpus, fp32), and ones that differ are refused in one line."""
    data = tmp_path / "data.txt"
    data.write_text("".join(f"line {i}: the quick brown fox {i * 7 % 13}\n" for i in range(300)))
    out = tmp_path / "out"
    cli.finetune("--dataset", data, "--block-size", "32", "--bf16", "--output-dir", out,
                 "--max_steps", "2", "--save_steps", "1", "--per_device_train_batch_size", "2",
                 "--gradient_accumulation_steps", "2")  # fmt: skip
    record = json.loads((out / "zerotune_job.json").read_text())
    assert record["dataset"] == str(data.resolve()) and record["dtype"] == "bf16"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()  # a relative --output-dir, from another working folder
    proc = cli.finetune("--output-dir", os.path.relpath(out, elsewhere), "--resume",
                        "--max_steps", "3", "--save_steps", "1", cwd=elsewhere)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(out)
    assert s["dataset"] == str(data.resolve()) and s["block_size"] == 32
    assert s["zero"]["dtype"] == "bf16"
    assert (s["global_step"], s["steps_this_run"]) == (3, 1)
    # The Trainer's flags not given again are the run's: micro-batch 2, accumulation 2.
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["train_batch_size"] == 2
    args = json.loads((out / "training_args.json").read_text())
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (2, 2)
    other = tmp_path / "other.txt"
    other.write_text(data.read_text())
    refused = {
        f"--dataset {data.resolve()} (now {other})": ["--dataset", other],
        "--block-size 32 (now 16)": ["--block-size", "16"],
        "dtype bf16 (now fp16)": ["--fp16"],
        "dtype bf16 (now fp32)": ["--bf16", "False"],  # the flag's value, not its name
    }
    resumed = ["--output-dir", out, "--resume", "--max_steps", "4"]
    procs = cli.finetune_all({named: [*resumed, *extra] for named, extra in refused.items()})
    for named, proc in procs.items():
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert named in proc.stderr and "--resume_from_checkpoint" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert summary(out)["global_step"] == 3  # nothing was trained or written by those
    # A config file that gives the same dtype is the run's own.
    config = tmp_path / "bf16.yaml"
    config.write_text("stage: 3\ndtype: bf16\n")
    cli.finetune("--output-dir", out, "--resume", "--config", config, "--max_steps", "4")
    assert summary(out)["zero"]["dtype"] == "bf16" and summary(out)["global_step"] == 4
    # zerotune export of the run folder: its newest complete checkpoint, in the training
    # dtype (bf16); one whose zerotune files were cut short is skipped.
    (out / "checkpoint-4" / "zero" / "COMPLETE").unlink(missing_ok=True)
    exported = cli.run("export", out, tmp_path / "model", "--quiet")
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert "bf16" in exported.stdout and "checkpoint-4" in exported.stderr
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    direct = cli.run("export", out / "checkpoint-3", tmp_path / "model3", "--quiet")
    assert direct.returncode == 0, direct.stderr[-2000:]
    assert (tmp_path / "model3" / "model.safetensors").read_bytes() == (
        tmp_path / "model" / "model.safetensors"
    ).read_bytes()
    (out / "zerotune_job.json").write_text("[]")  # damaged: one line, not a traceback
    proc = cli.finetune("--output-dir", out, "--resume", check=False)
    assert proc.returncode == 2 and "not a JSON object" in proc.stderr, proc.stderr[-2000:]
    # A record alone (a run stopped before its first checkpoint) is no run to protect.
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "zerotune_job.json").write_text(json.dumps(record))
    cli.finetune("--output-dir", lone, "--max_steps", "1")
    assert json.loads((lone / "zerotune_job.json").read_text())["dataset"] is None


def test_local_model_folder_and_jsonl(cli, tmp_path):
    """A local HF folder (with its tokenizer) and prompt/response jsonl, ZeRO-2 with CPU
    optimizer offload, an eval split, an optimizer other than AdamW (--optim adafactor),
    compiled blocks (--torch_compile)."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from zerotune.hf.data import byte_tokenizer

    folder = tmp_path / "model"
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=259, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    data = tmp_path / "qa.jsonl"
    rows = [{"prompt": f"Q: {a}+{a % 7}=", "response": f" {a + a % 7}\n"} for a in range(300)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    proc = cli.finetune("--model", folder, "--dataset", data, "--output-dir", out,
                        "--stage", "2", "--offload", "cpu", "--eval-split", "0.2", "--block-size",
                        "32", "--max_steps", "4", "--logging_steps", "1",
                        "--learning_rate", "1e-2", "--optim", "adafactor",
                        "--torch_compile", "--torch_compile_backend", "aot_eager")  # fmt: skip
    s = summary(out)
    blocks = f"{s['train_blocks']} blocks of 32 tokens (+{s['eval_blocks']} held out)"
    assert blocks in proc.stdout, proc.stdout
    assert s["init"] == "pretrained" and s["columns"].startswith("prompt column 'prompt'")
    assert (s["zero"]["stage"], s["zero"]["offload_optimizer"]) == (2, "cpu")
    assert s["eval_blocks"] > 0 and s["eval_loss"] is not None
    assert s["tokenizer"].startswith("tokenizer of")
    before = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert not torch.equal(
        before["transformer.h.0.mlp.c_fc.weight"], after["transformer.h.0.mlp.c_fc.weight"]
    )


def test_a_deepspeed_config_sets_the_zero_settings(cli, tmp_path):
    """--deepspeed ds_config.json: its ZeRO section chooses the stage and offload (the
    default job's NVMe offload does not override it), "auto" values follow the flags."""
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                              "overlap_comm": True, "reduce_bucket_size": "auto"},
        "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto",
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                      "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    }))  # fmt: skip
    out = tmp_path / "out"
    cli.finetune("--output-dir", out, "--deepspeed", ds, "--max_steps", "3",
                 "--learning_rate", "1e-3", "--warmup_steps", "0", "--logging_steps", "1",
                 "--save_strategy", "steps", "--save_steps", "3")  # fmt: skip
    s = summary(out)
    assert (s["zero"]["stage"], s["zero"]["offload_optimizer"]) == (2, "cpu")
    assert s["zero"]["offload_param"] == "none" and s["global_step"] == 3
    # DeepSpeed's log warmup over 2 steps (no --warmup_steps): 0, 0, then the full rate.
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert [h["learning_rate"] for h in state["log_history"] if "loss" in h] == [0, 0, 1e-3]


def test_fsdp_settings_set_the_zero_settings(cli, tmp_path):
    """A bare --fsdp with its settings in --fsdp_config (inline JSON): stage 3 with
    parameters and optimizer state on the CPU tier (the default job's NVMe offload does not
    override it)."""
    out = tmp_path / "out"
    cli.finetune("--output-dir", out, "--fsdp", "--fsdp_config", '{"cpu_offload": true}',
                 "--max_steps", "2")  # fmt: skip
    s = summary(out)
    zero = s["zero"]
    assert (zero["stage"], zero["offload_param"], zero["offload_optimizer"]) == (3, "cpu", "cpu")
    assert s["global_step"] == 2


def test_a_deepspeed_schedule_longer_than_the_epochs(cli, tmp_path):
    """Trained by epochs, the run's length is known once the model is built: a schedule
    of another length stops there, with one error line, exit code 2 and nothing written."""
    ds = tmp_path / "ds_config.json"
    ds.write_text('{"zero_optimization": {"stage": 3}, "scheduler": {"type": '
                  '"WarmupDecayLR", "params": {"total_num_steps": 999}}}')  # fmt: skip
    out = tmp_path / "out"
    proc = cli.finetune("--output-dir", out, "--deepspeed", ds, "--max_steps", "-1",
                        "--num_train_epochs", "1", check=False)  # fmt: skip
    errors = [x for x in proc.stderr.splitlines() if x.strip() and "building the model" not in x]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith("zerotune finetune: error: --deepspeed: scheduler.params."
                                "total_num_steps=999 but the run has ")  # fmt: skip
    assert not out.exists()


def test_chat_data_with_a_template_file(cli, tmp_path):
    """ShareGPT conversations with a template given as a file: one conversation a block,
    the loss goes down, and the template is saved with the tokenizer."""
    from transformers import AutoTokenizer

    data = tmp_path / "chat.jsonl"
    rows = [
        {
            "conversations": [
                {"from": "human", "value": f"Say {i}"},
                {"from": "gpt", "value": f"{i}!"},
            ]
        }
        for i in range(40)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    out = tmp_path / "out"
    proc = cli.finetune("--dataset", data, "--chat-template", template, "--output-dir", out,
                        "--block-size", "32", "--max_steps", "6", "--logging_steps", "1",
                        "--learning_rate", "1e-2", "--save_strategy", "no")  # fmt: skip
    s = summary(out)
    assert s["columns"] == "chat column 'conversations'" and s["train_blocks"] == 40
    assert "40 blocks of 32 tokens (chat column 'conversations'" in proc.stdout
    assert s["losses"][-1][1] < s["losses"][0][1]
    assert AutoTokenizer.from_pretrained(out).chat_template == template.read_text()
    # --packing: three conversations (about 30 tokens each) a block of 96.
    packed = tmp_path / "packed"
    proc = cli.finetune("--dataset", data, "--chat-template", template, "--output-dir", packed,
                        "--block-size", "96", "--max_steps", "6", "--logging_steps", "1",
                        "--learning_rate", "1e-2", "--save_strategy", "no",
                        "--packing")  # fmt: skip
    s = summary(packed)
    assert s["train_blocks"] == 14 and s["packing"] is True, s
    assert "14 blocks of 96 tokens packed (chat column 'conversations'" in proc.stdout
    assert s["losses"][-1][1] < s["losses"][0][1]
    assert json.loads((packed / "zerotune_job.json").read_text())["packing"] is True


def test_hub_id_from_the_local_cache_with_memory_options(env, tmp_path):
    """A hub id that is in the Hugging Face cache loads offline (HF_HUB_OFFLINE=1), the way
    a downloaded model would: the cache layout is what huggingface_hub writes."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from zerotune.hf.data import byte_tokenizer

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--zt-test--tiny-gpt2"
    snapshot = repo / "snapshots" / revision
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=259, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(snapshot)
    byte_tokenizer().save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    out = tmp_path / "out"
    env = {**env, "HF_HOME": str(tmp_path / "hf")}
    # With the memory extras: 8-bit Adam states and offloaded activation checkpoints are
    # TrainingArguments / ZeroTrainingArguments flags the command passes on.
    # Spelled as TrainingArguments flags; an NVMe folder that does not exist yet is made.
    swap = tmp_path / "not" / "yet"
    runs = {
        "cached": ["--model", "zt-test/tiny-gpt2", "--output_dir", out, "--block_size", "32",
                   "--max_steps", "8", "--logging_steps", "4", "--save_strategy", "no",
                   "--learning_rate", "1e-2", "--optim", "adamw_8bit", "--nvme_path", swap,
                   "--gradient_checkpointing", "--offload_activations", "nvme"],
        # Not in the cache: one line naming the cache, exit code 2.
        "absent": ["--model", "zt-test/absent", "--output-dir", tmp_path / "o2"],
    }  # fmt: skip
    done = finetune_in_new_process(env, runs)  # its own HF_HOME, read at import
    proc = done["cached"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert swap.is_dir() and f"swap files in {swap} (" in proc.stdout
    assert "GiB free)" in proc.stdout
    s = summary(out)
    assert s["init"] == "pretrained" and s["global_step"] == 8
    assert s["tokenizer"].startswith("tokenizer of")
    assert s["zero"]["optim_state_bits"] == 8 and s["zero"]["offload_activations"] == "nvme"
    memory = s["memory_rank0"]
    assert memory["engine_checkpoints_device"] == 0
    assert memory["engine_checkpoints_offloaded_peak"] > 0
    # The swap files counted include the activation checkpoints' (the summary said none).
    assert memory["nvme"] == memory["engine_checkpoints_file"] > 0
    assert f"nvme {memory['nvme'] / 2**20:,.1f} MiB (swap files)" in proc.stdout
    assert s["losses"][-1][1] < s["losses"][0][1]
    assert "activation checkpoints on nvme, 8-bit Adam states" in proc.stderr + proc.stdout
    proc = done["absent"]
    assert proc.returncode == 2 and "local Hugging Face cache" in proc.stderr


def test_two_processes(env, tmp_path):
    out = tmp_path / "out"
    proc = finetune(env, "--output-dir", out, "--nproc-per-node", "2", "--max_steps", "4",
                    "--save_strategy", "no", "--logging_steps", "1", "--eval-split", "0.2",
                    "--eval_strategy", "steps", "--eval_steps", "2")  # fmt: skip
    s = summary(out)
    assert s["world_size"] == 2 and s["global_step"] == 4 and len(s["losses"]) == 4
    assert s["eval_loss"] is not None
    assert "launching 2 processes" in proc.stderr
    assert not list(Path(env["TMPDIR"]).glob("zerotune-nvme-*"))
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)


def test_ranks_without_nvme_room_print_one_line(env, tmp_path):
    """Under --nproc-per-node the ranks build the engine (and check the NVMe space); their
    identical messages come out once, with no torchrun report around them."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)]).returncode:
        pytest.fail("this test needs to mount a small tmpfs (run as root)")
    try:
        out = tmp_path / "out"
        proc = finetune(env, "--output-dir", out, "--nvme-path", small, "--nproc-per-node", "2",
                        "--max_steps", "2", check=False)  # fmt: skip
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = [x for x in proc.stderr.splitlines() if "error" in x.lower() or "signal" in x]
        assert len(lines) == 1, proc.stderr[-3000:]
        assert lines[0].startswith("zerotune finetune: error: nvme_path ")
        assert "KiB free; this run needs 1.50 MiB of swap files (2 rank(s) here" in lines[0]
        assert "Traceback" not in proc.stderr and not out.exists()
        assert list(small.iterdir()) == []
        assert not list(Path(env["TMPDIR"]).glob("zerotune-errors-*"))
    finally:
        subprocess.run(["umount", str(small)])


def test_the_output_folder_of_an_earlier_run(default_run, cli, tmp_path):
    """A folder holding an earlier run is refused (its checkpoints would be rotated away or
    resumed from as this run's) unless --resume or --overwrite; --overwrite replaces that
    run's files once the input has been checked and leaves the user's own alone, and
    refuses to run with --resume or on inputs inside the folder. The TrainingArguments
    offload flags replace the default job's NVMe tiers."""
    out, _ = default_run
    earlier = tmp_path / "earlier"
    shutil.copytree(out, earlier)
    (earlier / "notes.txt").write_text("mine")
    before = sorted(p.name for p in earlier.iterdir())
    refused = {
        "holds an earlier run (checkpoint-20, checkpoint-40, config.json": [],
        "--overwrite replaces the run that --resume would continue": ["--overwrite", "--resume"],
        "--dataset": ["--overwrite", "--dataset", earlier / "notes.txt"],
        "safetensors": ["--overwrite", "--model", tmp_path / "broken"],  # found on loading
        # found while tokenizing, after the model is built: the earlier run is still kept
        "makes no block of 64 tokens": ["--overwrite", "--dataset", tmp_path / "tiny.txt",
                                        "--block-size", "64"],
    }  # fmt: skip
    (tmp_path / "tiny.txt").write_text("tiny")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text((out / "config.json").read_text())
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"\x05")
    at_once = {m: ["--output-dir", earlier, "--max_steps", "2", *a] for m, a in refused.items()}
    for message, proc in cli.finetune_all(at_once).items():
        assert proc.returncode == 2 and message in proc.stderr, (message, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in earlier.iterdir()) == before
    # --overwrite of the earlier run, and a folder holding only the user's own files (no
    # earlier run: the run writes next to them).
    other = tmp_path / "other"
    other.mkdir()
    (other / ".gitkeep").write_text("")
    runs = {
        "overwrite": ["--output-dir", earlier, "--max_steps", "2", "--overwrite",
                      "--offload_param", "cpu", "--offload_optimizer", "cpu"],
        "beside": ["--output-dir", other, "--max_steps", "2"],
    }  # fmt: skip
    for name, proc in cli.finetune_all(runs).items():
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    assert (other / ".gitkeep").exists() and summary(other)["global_step"] == 2
    s = summary(earlier)
    assert s["global_step"] == 2
    assert [p.name for p in earlier.glob("checkpoint-*")] == ["checkpoint-2"]  # 20, 40 gone
    assert (earlier / "notes.txt").read_text() == "mine"
    assert (s["zero"]["offload_param"], s["zero"]["offload_optimizer"]) == ("cpu", "cpu")
    assert s["zero"]["nvme_path"] is None
    # Resuming from a checkpoint kept elsewhere starts the folder afresh: --overwrite works.
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(out / "checkpoint-20", elsewhere / "checkpoint-20")
    cli.finetune("--output-dir", earlier, "--overwrite", "--max_steps", "22",
                 "--resume_from_checkpoint", elsewhere / "checkpoint-20")  # fmt: skip
    s = summary(earlier)
    assert (s["global_step"], s["steps_this_run"]) == (22, 2)
    assert (elsewhere / "checkpoint-20").is_dir() and (earlier / "notes.txt").exists()
    # The zerotune config given by its TrainingArguments name sets the default job's tiers.
    stage2 = tmp_path / "stage2.yaml"
    stage2.write_text("stage: 2\n")
    cli.finetune("--output-dir", tmp_path / "zc", "--max_steps", "1", "--zero_config", stage2)
    zero = summary(tmp_path / "zc")["zero"]
    assert (zero["stage"], zero["offload_optimizer"], zero["offload_param"]) == (2, "none", "none")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    proc = cli.finetune("--output-dir", a_file / "sub", check=False)
    assert proc.returncode == 2 and "is not a folder" in proc.stderr, proc.stderr


def test_bad_input_is_one_line_and_exit_code_2(env, cli, tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "no closing brace"\n')
    good_json = tmp_path / "good.jsonl"
    good_json.write_text('{"body": "a"}\n{"body": "b"}\n')
    impossible = tmp_path / "impossible.yaml"
    impossible.write_text("stage: 2\noffload_param: nvme\n")
    t5_config = tmp_path / "t5.json"
    t5_config.write_text('{"model_type": "t5", "d_model": 32, "num_layers": 1}')
    opt_config = tmp_path / "opt.json"
    opt_config.write_text(
        '{"model_type": "opt", "hidden_size": 16, "num_hidden_layers": 1, "ffn_dim": 32, '
        '"num_attention_heads": 2, "word_embed_proj_dim": 16, "vocab_size": 300}'
    )
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "a"}, '
                    '{"role": "assistant", "content": "b"}]}\n' * 4)  # fmt: skip
    small = tmp_path / "small"
    small.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)])
    if mount.returncode != 0:
        pytest.fail("this test needs to mount a small tmpfs (run as root)")
    evaluated = ["--eval_strategy", "steps", "--eval-split", "0.1"]
    job = tmp_path / "job.yaml"
    job.write_text("training:\n  stage: 3\n")
    ds_clip = tmp_path / "ds_clip.json"
    ds_clip.write_text('{"zero_optimization": {"stage": 3}, "gradient_clipping": 0.3}')
    ds_broken = tmp_path / "ds_broken.json"
    ds_broken.write_text('{"zero_optimization": {"stage": 3}')
    ds_long = tmp_path / "ds_long.json"
    ds_long.write_text('{"zero_optimization": {"stage": 3}, "scheduler": {"type": '
                       '"WarmupDecayLR", "params": {"total_num_steps": 999}}}')  # fmt: skip
    ds_cycle = tmp_path / "ds_cycle.json"
    ds_cycle.write_text('{"zero_optimization": {"stage": 3}, "scheduler": {"type": "OneCycle"}}')
    cases = {
        "unknown model": (["--model", "no-such-org/no-such-model"], "unknown model"),
        "preset without --init": (["--model", "gpt2-xl"], "add --init random"),
        "not a causal LM": (
            ["--model", t5_config, "--init", "random"],
            "no causal language model class for 't5' models",
        ),
        "missing column": (["--dataset", good_json], "no text column"),
        "unreadable file": (["--dataset", bad_json], "bad.jsonl, line 1, column 28: not valid"),
        "impossible config": (["--config", impossible], "impossible zerotune configuration"),
        "nvme without space": (["--offload", "nvme", "--nvme-path", small], "free; this run needs"),
        "bad choice": (["--stage", "4"], "Invalid value for '--stage'"),
        "unknown flag": (["--no_such_flag", "3"], "unknown option(s): --no_such_flag 3"),
        "renamed flag": (["--warmup_ratio", "0.1"], "fraction in --warmup_steps"),
        "nothing to resume": (
            ["--resume_from_checkpoint", tmp_path],
            "not a ZeroTrainer checkpoint",
        ),
        # TrainingArguments values the Trainer would only trip over once running
        "negative lr": (["--learning_rate", "-1"], "--learning_rate must be >= 0"),
        "zero epsilon": (["--adam_epsilon", "0"], "--adam_epsilon must be > 0"),
        "zero batch": (["--per_device_train_batch_size", "0"], "must be at least 1"),
        "zero accumulation": (["--gradient_accumulation_steps", "0"], "must be at least 1"),
        "nothing to train": (["--max_steps", "0"], "nothing to train"),
        "activations unchecked": (["--offload_activations", "cpu"], "--activation_checkpointing"),
        "schedule without kwargs": (
            ["--lr_scheduler_type", "warmup_stable_decay"],
            "--lr_scheduler_type warmup_stable_decay",
        ),
        "unknown best metric": (
            ["--load_best_model_at_end", *evaluated, "--metric_for_best_model", "accuracy"],
            "computes no metric but the loss",
        ),
        "best metric to save by": (
            ["--save_strategy", "best", *evaluated, "--metric_for_best_model", "accuracy"],
            "computes no metric but the loss",
        ),
        "compile mode": (["--torch_compile_mode", "reduce-overhead"], "records CUDA graphs"),
        "two configs": (
            ["--config", "zero3", "--zero_config", impossible],
            "config once",
        ),  # fmt: skip
        "compile backend": (["--torch_compile_backend", "nope"], "has no backend 'nope'"),
        "optim args": (["--optim_args", "foo=1"], "--optim_args is not read"),
        "optim not installed": (["--optim", "schedule_free_sgd"], "cannot run here"),
        "optim for the whole model": (["--optim", "galore_adamw"], "hooks into the whole"),
        "no tensorboard": (["--report_to", "tensorboard"], "its package is not installed"),
        "zero block size": (["--block-size", "0"], "--block-size must be at least 1"),
        "packing text": (["--packing"], "--packing is for chat data or prompt/response"),
        "packing opt": (
            ["--model", opt_config, "--init", "random", "--dataset", chat, "--packing"],
            "--packing: a opt model takes its positions from the attention mask",
        ),
        "missing model folder": (["--model", tmp_path / "nope"], "no such file or folder"),
        "two output folders": (["--output_dir", tmp_path / "b"], "--output-dir is given more"),
        "a Trainer flag twice": (
            ["--learning_rate", "1e-3", "--learning-rate=2e-3"],
            "--learning-rate is given more than once (--learning_rate, then --learning-rate)",
        ),
        "abbreviated flag": (["--learning_rat", "0.1"], "did you mean --learning_rate?"),
        "job file key": (["--job", job], "'training.stage' is not a known key; did you mean"),
        "missing job file": (["--job", tmp_path / "nope.yaml"], "nope.yaml: No such file"),
        "misspelt flag": (["--gradient_acumulation_steps", "2"], "--gradient_accumulation_steps?"),
        "deepspeed contradiction": (
            ["--deepspeed", ds_clip],
            "gradient_clipping=0.3 but --max_grad_norm is 1.0",
        ),
        "deepspeed and config": (["--deepspeed", ds_clip, "--config", "zero3"], "keep one"),
        "deepspeed not json": (["--deepspeed", ds_broken], "cannot read"),
        "deepspeed one cycle without its rates": (["--deepspeed", ds_cycle], "OneCycle needs "),
        "fsdp no shard": (["--fsdp", "no_shard"], "--fsdp no_shard (plain data parallelism"),
        "fsdp and deepspeed": (["--fsdp", "full_shard", "--deepspeed", ds_clip], "keep one"),
        "deepspeed schedule steps": (
            ["--deepspeed", ds_long, "--max_steps", "3"],
            "scheduler.params.total_num_steps=999 but the run has 3",
        ),
    }
    # Each its own process for a few (what a process prints beside the CLI's own line, e.g.
    # import warnings, shows there); the rest in the module's process.
    alone = ("unknown model", "nvme without space", "unknown flag")
    runs = {
        name: ["--output-dir", tmp_path / "out" / name.replace(" ", "-"), *args]
        for name, (args, _) in cases.items()
    }
    try:
        done = finetune_each(env, {name: runs[name] for name in alone})
        done.update(cli.finetune_all({n: a for n, a in runs.items() if n not in alone}))
        results = {name: (p.returncode, p.stdout, p.stderr) for name, p in done.items()}
    finally:
        subprocess.run(["umount", str(small)])
    assert set(results) == set(cases)
    for name, (code, _, stderr) in results.items():
        lines = stderr.strip().splitlines()
        assert code == 2, (name, stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("zerotune finetune: error: "), (name, lines)
        assert cases[name][1] in lines[0], (name, lines[0])
    assert not (tmp_path / "out").exists()  # nothing written for any of them
    assert not list(Path(env["TMPDIR"]).glob("zerotune-nvme-*"))


# As started from a terminal: Ctrl-C raises KeyboardInterrupt. A process started in the
# background of a non-interactive shell (a test suite run with `&`) inherits SIGINT
# ignored, and Python then leaves it ignored.
INTERRUPTIBLE = [
    sys.executable,
    "-c",
    "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from zerotune.cli import main; main()",
    "finetune",
]


def _interrupted(env, args, ready, what: str):
    """Run finetune with ``args`` in its own process group; once ``ready()``, send SIGINT to
    the group as a terminal's Ctrl-C does. Returns (exit code, stderr)."""
    import signal
    import time

    proc = subprocess.Popen(
        [*INTERRUPTIBLE, *map(str, args), "--disable_tqdm", "true"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**env, "PYTHONFAULTHANDLER": "1"}, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not ready():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"no {what} within 240 s"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            # Still running: SIGABRT makes faulthandler print every thread's stack.
            os.killpg(proc.pid, signal.SIGABRT)
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"no exit within 120 s of SIGINT\n{out[-3000:]}\n{err[-6000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, stderr


def test_an_interrupt_before_the_first_checkpoint_offers_no_resume(env, tmp_path):
    out = tmp_path / "out"
    args = ["--output-dir", out, "--max_steps", "2000", "--save_steps", "1000"]
    # The job record is written just before training starts.
    code, stderr = _interrupted(env, args, (out / "zerotune_job.json").exists, "training")
    assert code == 130, stderr[-3000:]
    line = "zerotune finetune: stopped by SIGINT before the first checkpoint"
    assert stderr.strip().splitlines()[-1] == line, stderr[-3000:]
    assert "--resume" not in stderr and not list(out.glob("checkpoint-*"))


@pytest.mark.parametrize("nproc", [1, 2])
def test_an_interrupted_run_ends_in_one_line(nproc, env, tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) of a run in one
    process or --nproc-per-node 2: exit code 130, one line naming the signal and --resume
    (one process printed click's 'Aborted!' and exited with 1), no traceback, complete
    checkpoints kept, the temporary NVMe folder gone."""
    out = tmp_path / "out"
    args = ["--output-dir", out, "--nproc-per-node", nproc, "--max_steps", "2000",
            "--save_steps", "4"]  # fmt: skip

    def ready() -> bool:  # one checkpoint is complete: its marker comes last
        return bool(list(out.glob(f"checkpoint-*/{TRAINER_MARKER}")))

    code, stderr = _interrupted(env, args, ready, "checkpoint")
    assert code == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.count("stopped by SIGINT") == 1 and "--resume" in stderr
    assert "Aborted!" not in stderr, stderr[-3000:]
    assert list(out.glob("checkpoint-*"))
    assert not list(Path(env["TMPDIR"]).glob("zerotune-nvme-*"))


def test_a_folder_another_run_holds_is_refused_naming_it(env, cli, tmp_path):
    """A run (or a resume) into a folder another live run holds: one line naming its pid,
    exit 2, nothing written; in one process and before a launcher starts its ranks."""
    out = tmp_path / "out"
    hold = (
        "import sys, time\n"
        "from zerotune.checkpoint.lock import FolderLock\n"
        "FolderLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(out)], stdout=subprocess.PIPE, env=env
    )
    try:
        assert holder.stdout.readline().strip() == b"held"
        two = ["--output-dir", out, "--max_steps", "1", "--nproc-per-node", "2"]
        done = finetune_each(env, {"two": two})  # a launcher: a process of its own
        done["one"] = cli.finetune("--output-dir", out, "--max_steps", "1", check=False)
    finally:
        holder.kill()
        holder.wait()
    for name, proc in done.items():
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (name, proc.stderr[-2000:])
        assert len(lines) == 1, (name, lines)
        assert f"is in use by another zerotune run (pid {holder.pid})" in lines[0], name
    assert [p.name for p in out.iterdir()] == [".zerotune.lock"]
