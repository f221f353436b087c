"""Sharded checkpoints: exact resume, resume at other world sizes, and every way a checkpoint
can be broken (missing, corrupt, tampered, incomplete, another model)."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from conftest import OddNet, run_world, tiny_gpt2
from harness import GLOBAL_BATCH, LR, WD, batches, build, loss_of, no_decay_groups

import zerotune
from zerotune.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

STEPS = 6
SAVE_AT = 3


def dropout_gpt2(seed: int):
    """The tiny GPT-2 with dropout on: resuming exactly needs the RNG states back."""
    model = tiny_gpt2(seed=seed)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1
    return model.train()


def make_engine(model, config=None, scheduler=False):
    groups = no_decay_groups(model, WD)  # reads shapes before sharding empties them
    engine = zerotune.shard(model, config or {"stage": 3})
    opt = zerotune.ZeroAdamW(engine, groups, lr=LR)
    sched = None
    if scheduler:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))
    return engine, opt, sched


def train_step(engine, opt, sched, ids, rank, world) -> float:
    per = GLOBAL_BATCH // world
    loss = loss_of(engine, ids[rank * per : (rank + 1) * per])
    engine.backward(loss)
    opt.clip_grad_norm_(0.5)
    opt.step()
    if sched is not None:
        sched.step()
    total = loss.detach().clone()
    if world > 1:
        torch.distributed.all_reduce(total)
    return float(total) / world


# ------------------------------------------------------------------------ exact resume
def save_then_continue(rank, world, root, model_name, config):
    """The run that never stops: saves at SAVE_AT and goes on. Returns its losses."""
    torch.manual_seed(100 + rank)
    model = dropout_gpt2(0) if model_name == "dropout" else build(model_name)
    engine, opt, sched = make_engine(model, config, scheduler=True)
    losses = []
    for i, ids in enumerate(batches("gpt2", STEPS)):
        losses.append(train_step(engine, opt, sched, ids, rank, world))
        if i + 1 == SAVE_AT:
            save_checkpoint(
                engine, root, step=SAVE_AT, scheduler=sched, extra={"next_batch": i + 1}
            )
    return {"losses": losses, "lr": opt.param_groups[0]["lr"]}


def resume(rank, world, root, model_name, config):
    """A fresh process state (other weights, other RNG) loads and continues."""
    torch.manual_seed(999)
    model = dropout_gpt2(7) if model_name == "dropout" else build(model_name)
    if model_name != "dropout":
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # loading must overwrite every weight
    engine, opt, sched = make_engine(model, config, scheduler=True)
    info = load_checkpoint(engine, root, scheduler=sched)
    losses = [
        train_step(engine, opt, sched, ids, rank, world)
        for ids in batches("gpt2", STEPS)[info.extra["next_batch"] :]
    ]
    return {"losses": losses, "lr": opt.param_groups[0]["lr"], "step": info.step}


def world2_cases(rank, world, tmp, reshard_root):
    """Everything that runs at world size 2, in one spawn: the exact resume with dropout,
    and resuming (at stage 2) the checkpoint saved at world size 3."""
    exact_root = f"{tmp}/exact"
    a = save_then_continue(rank, world, exact_root, "dropout", {"stage": 3})
    b = resume(rank, world, exact_root, "dropout", {"stage": 3})
    c = resume(rank, world, reshard_root, "gpt2", {"stage": 2})
    return {"never_stopped": a, "resumed": b, "from_world3": c}


@pytest.fixture(scope="module")
def world3(tmp_path_factory):
    root = tmp_path_factory.mktemp("world3")
    result = run_world(3, save_then_continue, str(root), "gpt2", {"stage": 3})[0]
    return root, result


@pytest.fixture(scope="module")
def world2(tmp_path_factory, world3):
    tmp = tmp_path_factory.mktemp("world2")
    return run_world(2, world2_cases, str(tmp), str(world3[0]))


def test_resume_continues_exactly_at_world_2(world2):
    # Dropout is on: equal losses need each rank's RNG state back, the moments, step
    # counts (bias correction), the scheduler, and every weight.
    for rank in (0, 1):
        never, resumed = world2[rank]["never_stopped"], world2[rank]["resumed"]
        assert resumed["step"] == SAVE_AT
        assert resumed["losses"] == never["losses"][SAVE_AT:]
        assert resumed["lr"] == never["lr"]


def test_resharding_3_to_2_and_3_to_1(world3, world2):
    root, never = world3
    expected = never["losses"][SAVE_AT:]
    from_3_to_2 = world2[0]["from_world3"]["losses"]
    np.testing.assert_allclose(from_3_to_2, expected, rtol=1e-5)
    from_3_to_1 = resume(0, 1, str(root), "gpt2", {"stage": 3})
    np.testing.assert_allclose(from_3_to_1["losses"], expected, rtol=1e-5)
    assert from_3_to_1["lr"] == never["lr"]


def test_manifest_describes_every_parameter_once(world3):
    root, _ = world3
    folder = root / f"step-{SAVE_AT:08d}"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["world_size"] == 3 and manifest["stage"] == 3
    names = [p["name"] for p in manifest["params"]]
    assert len(names) == len(set(names))
    wte = next(p for p in manifest["params"] if p["name"] == "transformer.wte.weight")
    assert wte["aliases"] == ["lm_head.weight"]  # tied: saved once
    assert wte["step"] == SAVE_AT
    for p in manifest["params"]:
        # The ranges cover the parameter exactly, in order.
        covered = [(a, b) for _, a, b, _ in p["ranges"]]
        assert covered[0][0] == 0 and covered[-1][1] == p["numel"]
        assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))
    ranks = sorted(n for n in manifest["files"] if n.startswith("rank-"))
    assert ranks == [f"rank-{r:05d}-of-00003.safetensors" for r in range(3)]
    assert (root / "latest").read_text().strip() == folder.name


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_resume_is_exact(tmp_path, dtype):
    # The bf16/fp16 copy is rebuilt from the fp32 master (rounded like the optimizer
    # writes it); fp16 also brings the loss scaler back.
    config = {"stage": 3, "dtype": dtype, "loss_scale_init": 2.0**8, "loss_scale_window": 2}
    a = save_then_continue(0, 1, str(tmp_path), "gpt2", config)
    b = resume(0, 1, str(tmp_path), "gpt2", config)
    assert b["losses"] == a["losses"][SAVE_AT:]


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_offloaded_state_resumes_exactly(tmp_path, tier):
    # The checkpoint holds the real master weights and moments wherever they live (read
    # through engine.unit_state), and loading writes them back to their tier.
    config = {"stage": 3, "offload_optimizer": tier, "offload_param": tier}
    if tier == "nvme":
        config.update(nvme_path=str(tmp_path), staging_bytes="1MiB")
    try:
        zerotune.ZeroConfig.from_dict(config)
    except zerotune.ConfigError as exc:
        pytest.skip(f"offload not available: {exc}")
    a = save_then_continue(0, 1, str(tmp_path / "ckpt"), "gpt2", config)
    b = resume(0, 1, str(tmp_path / "ckpt"), "gpt2", config)
    assert b["losses"] == a["losses"][SAVE_AT:]


def test_save_without_optimizer_state_then_resume_warns(tmp_path, caplog):
    engine, opt, _ = make_engine(build("odd"))
    save_checkpoint(engine, tmp_path, step=1, include_optimizer=False)
    engine2, opt2, _ = make_engine(build("odd"))
    with caplog.at_level(logging.WARNING):
        load_checkpoint(engine2, tmp_path)
    assert "no optimizer state" in caplog.text


# ------------------------------------------------------------------- broken checkpoints
@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A root with two complete checkpoints of the odd model (steps 1 and 2), world size 1."""
    root = tmp_path_factory.mktemp("two")
    engine, opt, _ = make_engine(build("odd"))
    weights = {}
    for step in (1, 2):
        ids = batches("odd", 1)[0]
        engine.backward(loss_of(engine, ids))
        opt.step()
        save_checkpoint(engine, root, step=step)
        weights[step] = engine.full_state_dict()
    return root, weights


@pytest.fixture
def root(two_checkpoints, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(two_checkpoints[0], copy)
    return copy


def fresh_odd():
    return make_engine(build("odd"))[0]


def weights_equal(engine, expected) -> bool:
    got = engine.full_state_dict()
    return all(torch.equal(got[n], expected[n]) for n in expected)


def test_loading_the_root_the_latest_file_or_the_folder(root, two_checkpoints):
    _, weights = two_checkpoints
    for path in (root, root / "latest", root / "step-00000002"):
        engine = fresh_odd()
        assert load_checkpoint(engine, path).step == 2
        assert weights_equal(engine, weights[2])
    engine = fresh_odd()
    assert load_checkpoint(engine, root / "step-00000001").step == 1
    assert weights_equal(engine, weights[1])


def test_latest_is_followed_when_it_names_a_complete_checkpoint(root, two_checkpoints):
    (root / "latest").write_text("step-00000001\n")
    engine = fresh_odd()
    assert load_checkpoint(engine, root).step == 1
    assert weights_equal(engine, two_checkpoints[1][1])
    assert zerotune.latest_checkpoint(root) == root / "step-00000001"


def test_incomplete_newest_falls_back_with_a_warning(root, two_checkpoints, caplog):
    (root / "step-00000002" / "COMPLETE").unlink()
    engine = fresh_odd()
    with caplog.at_level(logging.WARNING):
        info = load_checkpoint(engine, root)
    assert info.step == 1 and weights_equal(engine, two_checkpoints[1][1])
    assert "step-00000002 is incomplete" in caplog.text
    with pytest.raises(CheckpointError, match=r"step-00000002: incomplete checkpoint"):
        load_checkpoint(fresh_odd(), root / "step-00000002")


def test_latest_naming_a_missing_folder_falls_back(root, caplog):
    shutil.rmtree(root / "step-00000002")
    with caplog.at_level(logging.WARNING):
        assert load_checkpoint(fresh_odd(), root).step == 1
    assert "not a complete checkpoint" in caplog.text


def test_missing_rank_file_is_named(root):
    (root / "step-00000002" / "rank-00000-of-00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"rank-00000-of-00001\.safetensors: missing"):
        load_checkpoint(fresh_odd(), root)


def test_corrupt_rank_file_is_named(root):
    path = root / "step-00000002" / "rank-00000-of-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank-00000-of-00001\.safetensors: checksum"):
        load_checkpoint(fresh_odd(), root)


def test_truncated_rank_file_is_named(root):
    path = root / "step-00000002" / "rank-00000-of-00001.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"rank-00000-of-00001\.safetensors: \d+ bytes"):
        load_checkpoint(fresh_odd(), root)


def test_tampered_manifest_is_named(root):
    path = root / "step-00000002" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["params"][0]["offset"] += 1
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"manifest\.json: does not match its COMPLETE"):
        load_checkpoint(fresh_odd(), root)


def _rewrite_manifest(folder, change) -> None:
    """Change the manifest and write a COMPLETE marker that matches it (as a save would)."""
    import hashlib

    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))
    marker = json.loads((folder / "COMPLETE").read_text())
    marker["manifest_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (folder / "COMPLETE").write_text(json.dumps(marker))


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda m: m.pop("files"), r"at the top level: 'files' is a required property"),
        (lambda m: m.update(world_size="2"), r"at \['world_size'\]: '2' is not of type"),
        (lambda m: m["params"][0].pop("ranges"), r"at \['params'\]\[0\]: 'ranges' is a required"),
        (lambda m: m["params"][1].update(offset=-4), r"at \['params'\]\[1\]\['offset'\]"),
        (lambda m: m["units"].append(7), r"at \['units'\]\[\d+\]: 7 is not of type 'object'"),
    ],
)
def test_a_manifest_missing_its_fields_is_refused_in_one_line(root, change, says, tmp_path):
    """Valid JSON with a matching marker, but not what a save writes: refused on read, by
    resume and by export, in one line, instead of a KeyError deep inside."""
    from zerotune.checkpoint.export import export_hf

    _rewrite_manifest(root / "step-00000002", change)
    for call in (
        lambda: load_checkpoint(fresh_odd(), root / "step-00000002"),
        lambda: export_hf(root / "step-00000002", tmp_path / "out"),
    ):
        with pytest.raises(CheckpointError, match="malformed manifest " + says) as err:
            call()
        assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", ["", "garbage", "[1]"])
def test_an_unreadable_marker_is_named_not_skipped(root, text):
    """A COMPLETE marker is written whole by a rename, so one that is there but unreadable is
    damage: loading names it instead of falling back to the older checkpoint."""
    marker = root / "step-00000002" / "COMPLETE"
    marker.write_text(text)
    expected = r"step-00000002/COMPLETE: unreadable \(not a JSON object\): the checkpoint was"
    for where in (root, root / "step-00000002"):
        with pytest.raises(CheckpointError, match=expected):
            load_checkpoint(fresh_odd(), where)


def test_another_model_is_refused(root):
    with pytest.raises(CheckpointError, match=r"manifest\.json: the checkpoint is of a different"):
        load_checkpoint(zerotune.shard(OddNet(width=14)), root)
    with pytest.raises(CheckpointError, match=r"different model.*not saved"):
        load_checkpoint(zerotune.shard(tiny_gpt2()), root)


def test_no_checkpoint_at_all(tmp_path):
    with pytest.raises(CheckpointError, match=r"no such checkpoint folder"):
        load_checkpoint(fresh_odd(), tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty: no complete checkpoint"):
        load_checkpoint(fresh_odd(), tmp_path / "empty")
    # A Trainer's output folder none of whose checkpoints is complete: the message names its
    # newest checkpoint (by number).
    for step in (9, 10):
        (tmp_path / "run" / f"checkpoint-{step}").mkdir(parents=True)
    says = r"none of its Trainer checkpoints \(newest: checkpoint-10\) is complete$"
    with pytest.raises(CheckpointError, match=says):
        load_checkpoint(fresh_odd(), tmp_path / "run")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"holds model weights already"):
        load_checkpoint(fresh_odd(), tmp_path / "model")


def test_other_parameter_groups_are_refused(root):
    engine = zerotune.shard(build("odd"))
    zerotune.ZeroAdamW(engine, lr=LR)  # one group; the checkpoint has two
    with pytest.raises(CheckpointError, match=r"2 parameter group\(s\), this one 1"):
        load_checkpoint(engine, root)


def test_keep_last_rotation_and_interrupted_leftovers(tmp_path):
    engine, opt, _ = make_engine(build("odd"))
    leftover = tmp_path / "step-00000000"
    leftover.mkdir(parents=True)
    (leftover / "rank-00000-of-00002.safetensors").write_bytes(b"partial")
    # A removal killed after its rank files were gone leaves the renamed, hidden folder.
    cut_short = tmp_path / ".removing-step-00000000"
    cut_short.mkdir()
    (cut_short / "config.json").write_text("{}")
    for step in range(1, 5):
        save_checkpoint(engine, tmp_path, step=step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step-00000003",
        "step-00000004",
    ]
    assert (tmp_path / "latest").read_text().strip() == "step-00000004"


def test_saving_again_under_a_name_replaces_the_checkpoint_whole(tmp_path, monkeypatch):
    """A save under the name of a complete checkpoint leaves that one complete until the
    new one is (it used to be removed first): a save failing midway keeps the old one
    loadable, and one that completes replaces it, through the atomic exchange and through
    the fallback of two renames."""
    from zerotune.checkpoint import files, save

    engine, opt, _ = make_engine(build("odd"))
    save_checkpoint(engine, tmp_path, step=1, name="last")
    before = engine.full_state_dict()
    engine.backward(loss_of(engine, batches("odd", 1)[0]))
    opt.step()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(save, "_write_side_files", disk_full)
    with pytest.raises(CheckpointError, match="last failed: No space left on device"):
        save_checkpoint(engine, tmp_path, step=2, name="last")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "latest"]  # nothing staged
    monkeypatch.setattr(save, "_write_rank_file", disk_full)  # in phase 2 this time
    with pytest.raises(CheckpointError, match="writing .*last failed: No space left on device"):
        save_checkpoint(engine, tmp_path, step=2, name="last")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "latest"]
    again = fresh_odd()
    assert load_checkpoint(again, tmp_path).step == 1
    assert weights_equal(again, before)
    for exchange in (True, False):
        if not exchange:
            monkeypatch.setattr(save, "exchange_paths", lambda a, b: False)
        save_checkpoint(engine, tmp_path, step=2, name="last")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "latest"]
        again = fresh_odd()
        assert load_checkpoint(again, tmp_path).step == 2
        assert weights_equal(again, engine.full_state_dict())
    assert files.exchange_paths(tmp_path / "last", tmp_path / "latest")  # Linux: it exists
    files.exchange_paths(tmp_path / "last", tmp_path / "latest")


def test_saving_into_a_file_is_one_error(tmp_path):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    for target in (a_file, a_file / "under"):
        with pytest.raises(CheckpointError, match=r"cannot save a checkpoint into .*not a folder"):
            save_checkpoint(fresh_odd(), target, step=1)


def test_saving_into_a_checkpoint_folder_is_refused(root):
    with pytest.raises(CheckpointError, match=r"is a checkpoint folder; save into its parent"):
        save_checkpoint(fresh_odd(), root / "step-00000002", step=3)


def test_extra_must_be_json(tmp_path):
    with pytest.raises(CheckpointError, match=r"extra is not JSON-serializable"):
        save_checkpoint(fresh_odd(), tmp_path, step=1, extra={"x": object()})
