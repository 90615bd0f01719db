"""What one all-reduce costs inside a CUDA graph, at the sizes a tensor-parallel step makes: NCCL against the
symmetric-memory one-shot (offload_engine/distributed/symmetric_all_reduce.py), one process per GPU.

    python -m benchmarks.bench_all_reduce [--gpus 2] [--out benchmarks/results/<device>/all_reduce.json]

Per size (rows x 4,096 bf16: a decode step's rows, then prefill chunks), a graph of 72 all-reduces back to back (an
8B model's two per layer) is replayed; the JSON gives microseconds per all-reduce for each method, their ratio,
whether the one-shot's sum equals NCCL's bit for bit, and whether every rank got the same bits (the sampler
needs that). Needs two GPUs or more.
"""
import argparse
import datetime
import json
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.graph_timing import us_per_call

CALLS = 72
HIDDEN = 4096
ROWS = (1, 16, 64, 128, 256, 1024, 4096)


def _time_graph(run) -> float:
    """Microseconds per all-reduce of a graph of CALLS calls of `run`."""
    return us_per_call([run] * CALLS)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    from offload_engine.distributed.symmetric_all_reduce import SymmetricAllReduce

    symmetric = SymmetricAllReduce(dist.group.WORLD, device, torch.bfloat16, max_bytes=max(ROWS) * HIDDEN * 2)
    rows = []
    for count in ROWS:
        seeded = torch.Generator(device).manual_seed(rank)
        x = torch.randn(count, HIDDEN, device=device, dtype=torch.bfloat16, generator=seeded)
        reference = x.clone()
        dist.all_reduce(reference)
        total = symmetric(x)
        same = bool(torch.equal(total, reference))
        everywhere = [torch.empty_like(total) for _ in range(world)]
        dist.all_gather(everywhere, total)
        same_bits = all(torch.equal(everywhere[0], other) for other in everywhere)
        work = x.clone()
        nccl_us = _time_graph(lambda: dist.all_reduce(work))
        one_shot_us = _time_graph(lambda: symmetric(x))
        rows.append({"rows": count, "bytes": x.numel() * 2, "nccl_us": nccl_us, "one_shot_us": one_shot_us,
                     "nccl_over_one_shot": nccl_us / one_shot_us, "equal_to_nccl": same,
                     "same_bits_on_every_rank": same_bits})
        if rank == 0:
            print(f"  {count:5d} x {HIDDEN} bf16: NCCL {nccl_us:7.1f} us, one-shot {one_shot_us:7.1f} us "
                  f"({nccl_us / one_shot_us:.2f}x), equal to NCCL {same}, same bits on every rank {same_bits}",
                  flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "gpus": world, "calls_per_graph": CALLS,
                       "rows": rows}, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "all_reduce.json"))
    args = parser.parse_args()
    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}, but torch sees {torch.cuda.device_count()} GPU(s)")
    from offload_engine.distributed.workers import MULTICAST_OFF

    os.environ.update(MULTICAST_OFF)  # the one-shot needs no NVLink multicast; the device hosts keep it off
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_rank, args=(args.gpus, port, args.out), nprocs=args.gpus)
    from benchmarks.bench_long_context import commit

    found = json.load(open(args.out))
    found.update(date=datetime.date.today().isoformat(), commit=commit())
    with open(args.out, "w") as f:
        json.dump(found, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
