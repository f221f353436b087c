"""Shared helpers: tiny models and a multi-process runner (gloo on 127.0.0.1)."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import traceback

# Tiny models: one thread per process (OpenMP threads spinning on a shared 2-core machine
# cost more than they compute; ranks and scripts the tests start inherit this).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plain(obj):
    """Tensors to numpy, recursively, so results cross process boundaries simply."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj


def _pool_worker(rank, world, tasks, results):
    """One rank of a pool: runs task after task, each in its own gloo process group."""
    import torch.distributed as dist

    while True:
        task = tasks.get()
        if task is None:
            return
        port, fn, args, env, cwd = task
        # Each task sees the caller's environment and folder as they are now (a fresh
        # process would have), one thread and the default dtype.
        os.environ.clear()
        os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.chdir(cwd)
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float32)
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world)
            result = fn(rank, world, *args)
            results.put((rank, "ok", _plain(result)))
        except BaseException:  # noqa: BLE001 - the parent re-raises with the traceback
            results.put((rank, "error", traceback.format_exc()))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def _fork_context():
    """Rank processes are forked from multiprocessing's fork server, which imports torch,
    transformers' GPT-2 and zerotune once (~8 s of CPU) instead of each rank importing them
    again. It runs no tensor op, so it has no OpenMP threads that a fork would break."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["conftest", "harness", "transformers.models.gpt2.modeling_gpt2"])
    return ctx


def pytest_collection_modifyitems(items):
    """Start the fork server's imports now, on the core the first tests leave idle, when a
    collected test module runs ranks."""
    if any(getattr(getattr(i, "module", None), "run_world", None) is run_world for i in items):
        import multiprocessing.forkserver

        _fork_context()
        multiprocessing.forkserver.ensure_running()


class _RankPool:
    """``world`` rank processes kept for the session (see ``run_world``)."""

    def __init__(self, world: int):
        ctx = _fork_context()
        self.world = world
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(target=_pool_worker, args=(r, world, self.tasks[r], self.results))
            for r in range(world)
        ]
        for p in self.procs:
            p.daemon = True
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, args, timeout: float) -> list:
        port = _free_port()
        for q in self.tasks:
            q.put((port, fn, args, dict(os.environ), os.getcwd()))
        results: dict[int, object] = {}
        for _ in range(self.world):
            rank, status, payload = self.results.get(timeout=timeout)
            if status != "ok":
                raise AssertionError(f"rank {rank}:\n{payload}")
            results[rank] = payload
        return [results[r] for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.tasks:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join()


_POOLS: dict[int, _RankPool] = {}


def run_world(world: int, fn, *args, timeout: float = 300.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return each rank's result.

    World 1 runs in this process, without a process group. Larger worlds run on a pool of
    rank processes kept for the session; a failed or timed-out call discards its pool (the
    other ranks may be stuck in a collective), and the next call starts a new one.
    """
    if world == 1:
        return [_plain(fn(0, 1, *args))]
    pool = _POOLS.get(world)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(kill=True)
        pool = _POOLS[world] = _RankPool(world)
    try:
        return pool.run(fn, args, timeout)
    except BaseException:
        _POOLS.pop(world, None)
        pool.close(kill=True)
        raise


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    while _POOLS:
        _POOLS.popitem()[1].close()


class Started:
    """A process started now and read later: ``result()`` waits for it and returns what
    ``subprocess.run(command, capture_output=True, text=True)`` would have. Its output goes
    to files (a pipe not read yet could fill and stall it)."""

    def __init__(self, command: list[str], **popen):
        self.command = command
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(command, stdout=self.out, stderr=self.err, **popen)

    def result(self, timeout: float = 300) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.stop()
        out, err = (f.seek(0) or f.read() for f in (self.out, self.err))
        return subprocess.CompletedProcess(self.command, self.proc.returncode, out, err)

    def stop(self) -> None:
        """Ends it if it still runs (a test failed before reading it)."""
        self.proc.kill()
        self.proc.wait()


def run_together(*commands: list[str], timeout: float = 300, **popen) -> list:
    """``subprocess.run(command, capture_output=True, text=True)`` for each command, all
    started at once (one process leaves the second core idle); returns their
    ``CompletedProcess`` in order. Keyword arguments go to every ``Popen``."""
    started = [Started(command, **popen) for command in commands]
    try:
        return [s.result(timeout) for s in started]
    finally:
        for s in started:
            s.stop()


def start_for(request, test: str, command: list[str], **popen) -> Started | None:
    """For a module fixture: ``command`` started now when ``test`` is among the tests that
    will run (it reads the result), so that the process runs on the core the module's
    in-process tests leave idle; else None."""
    if not any(getattr(i, "originalname", i.name) == test for i in request.session.items):
        return None
    return Started(command, **popen)


def tiny_gpt2(seed: int = 0, layers: int = 2, tie: bool = True, **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    settings = dict(
        n_layer=layers,
        n_embd=32,
        n_head=2,
        vocab_size=96,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=tie,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(GPT2Config(**{**settings, **overrides}))


def tiny_llama_config(kind: str = "llama"):
    """A two-layer Llama, Qwen2 or Gemma2 config (Qwen2 and Gemma2 with tied embeddings;
    Gemma2's embedding scales its output by a buffer and has a padding row)."""
    from transformers import Gemma2Config, LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "gemma2": Gemma2Config}[kind]
    extra = dict(head_dim=16, pad_token_id=0) if kind == "gemma2" else {}
    return cls(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=96,
        tie_word_embeddings=(kind != "llama"),
        **extra,
    )


class OddNet(torch.nn.Module):
    """A non-HF model with odd parameter sizes, a root-level parameter and a ModuleList."""

    def __init__(
        self,
        vocab: int = 37,
        width: int = 13,
        hidden: int = 29,
        blocks: int = 3,
        mode: str = "plain",
    ):
        super().__init__()
        # mode "twice": the first block runs twice per forward; "switch": every other forward
        # runs the blocks in reverse order (another path through the units); "tied_twice":
        # the head has no parameter of its own (its weight is the embedding's) and runs
        # twice, on the embedding's output too.
        self.mode = mode
        self.calls = 0
        self.emb = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, width)
            )
            for _ in range(blocks)
        )
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=mode != "tied_twice")
        if mode == "tied_twice":
            self.head.weight = self.emb.weight
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, input_ids, labels=None):
        h = self.emb(input_ids)
        blocks = list(self.blocks)
        if self.mode == "twice":
            blocks = [blocks[0]] + blocks
        elif self.mode == "switch" and self.calls % 2 == 1:
            blocks = blocks[::-1]
        self.calls += 1
        for block in blocks:
            h = h + block(h)
        logits = self.head(self.norm(h) * self.gain)
        if self.mode == "tied_twice":
            logits = logits + self.head(self.emb(input_ids))
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def odd_net(seed: int = 0, mode: str = "plain") -> OddNet:
    torch.manual_seed(seed)
    return OddNet(mode=mode)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTUNE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


class _PeerBlock(torch.nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.ff = torch.nn.Sequential(
            torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, width)
        )
        object.__setattr__(self, "peer", None)  # a sibling block, not a submodule

    def forward(self, x):
        out = self.ff(x)
        if self.peer is not None:
            # Reads a sibling's weight: invisible at wrap time (peer is no submodule).
            out = out + torch.nn.functional.linear(
                x, self.peer.ff[2].weight @ self.peer.ff[0].weight
            )
        return out


class _Projector(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.eye(width) + 0.05 * torch.randn(width, width))

    def forward(self):
        return self.weight  # hands its own parameter to the caller


class ExternalNet(torch.nn.Module):
    """Parameters used outside their owner's forward: the parent projects onto the embedding
    with F.linear(h, self.emb.weight), block 1 reads block 0's weights, and a module returns
    its own parameter for the parent to use."""

    def __init__(self, vocab: int = 37, width: int = 13, hidden: int = 29):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(_PeerBlock(width, hidden) for _ in range(3))
        object.__setattr__(self.blocks[1], "peer", self.blocks[0])
        self.proj = _Projector(width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, input_ids, labels=None):
        h = self.emb(input_ids)
        for block in self.blocks:
            h = h + block(h)
        h = self.norm(h) @ self.proj()
        logits = torch.nn.functional.linear(h, self.emb.weight)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def external_net(seed: int = 0) -> ExternalNet:
    torch.manual_seed(seed)
    return ExternalNet()
