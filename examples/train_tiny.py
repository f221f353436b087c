"""Train the embedded default: tiny GPT-2 (configs/models/tiny-gpt2.json), ZeRO-3, bare PyTorch.

Byte-level tokens (ids 0-255, no tokenizer download), blocks of 64 bytes from
examples/tiny_corpus.txt. Runs on one process, or on several with
``torchrun --nproc-per-node 2 examples/train_tiny.py`` (gloo on CPU).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import zerotune  # noqa: E402
from zerotune import dist as zdist  # noqa: E402
from zerotune.hf import model_config  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--block", type=int, default=64)
    args = ap.parse_args()

    zdist.init_from_env()
    rank, world = zdist.get_rank(), zdist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the world size {world}")
    data = torch.tensor(list((HERE / "tiny_corpus.txt").read_bytes()), dtype=torch.long)
    blocks = data[: len(data) // args.block * args.block].view(-1, args.block)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config("tiny-gpt2"))
    engine = zerotune.shard(model, zerotune.ZeroConfig(stage=args.stage))
    optimizer = zerotune.ZeroAdamW(engine, lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    per_rank = args.batch // world
    losses = []
    for step in range(args.steps):
        pick = torch.randint(0, len(blocks), (args.batch,), generator=g)
        ids = blocks[pick[rank * per_rank : (rank + 1) * per_rank]]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        norm = optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        mean = loss.detach().reshape(1) / world
        zdist.all_reduce_sum(mean)
        losses.append(float(mean))
        if rank == 0:
            print(
                f"step {step + 1:3d}  loss {losses[-1]:.4f}  grad norm {float(norm):.3f}",
                flush=True,
            )
    if rank == 0:
        report = engine.memory_report()
        print(
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps; world {world}, "
            f"stage {args.stage}; per-rank bytes: params {report['params']:,}, "
            f"grads {report['grads']:,}, optimizer {report['optimizer'] + report['master']:,}"
        )
    if losses[-1] >= losses[0]:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        zdist.shutdown()  # a gloo group alive at exit can abort the process
        raise
    zdist.leave(0)  # no interpreter finalization: see [Note: leaving a gloo rank]
