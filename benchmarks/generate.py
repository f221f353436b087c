"""Time ``generate`` on a stage-3 sharded model: plain, unit by unit, and gathered once per call.

Three ways to generate the same greedy tokens, timed in one invocation with their order
rotating from round to round: the plain HF model (a full copy on each rank, no sharding),
the sharded model gathering each unit for each forward (one forward per new token; what
``ds3_gather_for_generation=False`` gives), and the sharded model gathered once per call
(``zerotune.hf.gather_for_generation``, what ZeroTrainer does by default at stage 3; see
[Note: gathered for generation] in zerotune/hf/generation.py). The tokens of the three are
compared. Run one rank with python, several with torchrun (gloo on CPUs, NCCL on GPUs):

    python benchmarks/generate.py                                  # gpt2, no offload
    python benchmarks/generate.py --offload nvme --nvme-path /tmp
    torchrun --nproc-per-node 2 benchmarks/generate.py --offload cpu --threads 1

The last line (rank 0) is one JSON object: the median seconds of each way (``plain_s``,
``per_unit_s``, ``gathered_s``), ``generate_time_ratio`` (gathered / plain),
``speedup_vs_per_unit`` (per unit / gathered) and ``same_tokens``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time

WAYS = ("plain", "per_unit", "gathered")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="gpt2", help="preset name or config.json path")
    ap.add_argument("--offload", default="none", choices=["none", "cpu", "nvme"])
    ap.add_argument("--nvme-path", default=None, help="swap folder for --offload nvme")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of the three ways")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    args = ap.parse_args()
    if min(args.batch, args.prompt, args.new_tokens, args.rounds) < 1:
        ap.error("--batch, --prompt, --new-tokens and --rounds must be at least 1")
    return args


def main() -> None:
    args = parse()
    import torch
    from transformers import AutoModelForCausalLM

    import zerotune
    from zerotune import dist as zdist
    from zerotune.hf import gather_for_generation, model_config

    zdist.init_from_env()
    rank, world = zdist.get_rank(), zdist.get_world_size()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    config = model_config(args.model)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).eval()
    plain = copy.deepcopy(base).to(device)
    swap = None
    zcfg = {"stage": 3, "offload_param": args.offload}
    if args.offload == "nvme":
        swap = tempfile.TemporaryDirectory(dir=args.nvme_path, prefix="zerotune-generate-")
        zcfg["nvme_path"] = swap.name
    engine = zerotune.ZeroEngine(base, zerotune.load_config(zcfg), device=device)
    sharded = engine.module
    torch.manual_seed(1 + rank)  # each rank its own prompts
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.prompt), device=device)

    def run(way: str):
        model = plain if way == "plain" else sharded
        if way != "plain":
            gather_for_generation(sharded, enabled=way == "gathered")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        zdist.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            ids = model.generate(
                prompt, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return ids.cpu(), time.perf_counter() - start

    tokens = {way: run(way)[0] for way in WAYS}  # warm-up, and the tokens compared
    same = all(torch.equal(tokens[way], tokens["plain"]) for way in WAYS)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for r in range(args.rounds):
        for way in WAYS[r % 3 :] + WAYS[: r % 3]:
            times[way].append(run(way)[1])
    engine.close()
    if swap is not None:
        swap.cleanup()
    # Every rank's medians; the slowest rank sets the pace.
    medians = torch.tensor([statistics.median(times[way]) for way in WAYS], device=device)
    flags = torch.tensor([0.0 if same else 1.0], device=device)
    if world > 1:
        zdist.all_reduce_max(medians)
        zdist.all_reduce_max(flags)
    plain_s, per_unit_s, gathered_s = medians.tolist()
    zdist.shutdown()
    if rank != 0:
        return
    shape = f"batch {args.batch}, prompt {args.prompt}, {args.new_tokens} new tokens"
    print(f"{args.model}, world {world}, offload {args.offload}, {shape}, {args.rounds} rounds")
    for way, s in zip(WAYS, (plain_s, per_unit_s, gathered_s)):
        print(f"  {way:9s} {s:8.3f} s  {s / plain_s:6.2f}x plain")
    result = {
        "model": args.model,
        "world": world,
        "offload": args.offload,
        "device": device.type,
        "new_tokens": args.new_tokens,
        "plain_s": round(plain_s, 4),
        "per_unit_s": round(per_unit_s, 4),
        "gathered_s": round(gathered_s, 4),
        "generate_time_ratio": round(gathered_s / plain_s, 3),
        "speedup_vs_per_unit": round(per_unit_s / gathered_s, 2),
        "same_tokens": not flags.item(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
