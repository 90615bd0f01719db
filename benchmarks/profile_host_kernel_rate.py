"""Where the host decode kernel's time goes over few, long sequences: memory or arithmetic, and which phase.

Each variant is a copy of the cpu_attention package with one textual change to its kernel sources (a constant,
a phase left out, a shuffle left out), renamed kernel_<variant> and compiled in a scratch directory, so the
variants are timed side by side in one run on one machine; --baseline adds the package as git has it at a
revision, or a copy of it (the device machines have no git history). Variants that leave work out compute wrong
results on purpose: they are timings, never outputs. Every variant is timed in its own subprocess (numba freezes a module's constants at
compile time), after all of them were compiled in parallel into one numba cache.

Per variant and query-head count (8 KV heads x D 128, bfloat16, block size 64):
  dram    1 x L on all --threads, the inputs rotating over >= --rotate-gb so every run reads DRAM;
  dram1   the same on one thread: what one core's memory-level parallelism allows;
  cache1  one thread, one KV head, L tokens whose table cycles over 16 blocks (512 KiB, they stay in L2): the
          kernel's arithmetic rate.
  lane    (--lane) decode_layers, the host lane's whole step, over every layer's pool, gates open.
The plain parallel sum (the host read ceiling, all threads and one) is measured in the same run.

    python3 benchmarks/profile_host_kernel_rate.py [--variants base,pf256] [--lane 36x32x2048] [--out FILE]
"""
import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_cpu_attention import median_seconds, read_ceiling_gbps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "cpu_attention"
GB = 1e9
KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 128, 64
CACHED_BLOCKS = 16  # cache1's K and V: 512 KiB, well inside one core's L2

_VALUES_CALL = "            values_bf16(v_cache[block, h], n, scores, accs[i], v_cache, next_run)\n"
_SCORES_CALL = ("            scores_bf16(q, h * group, group, k_cache[block, h], n, scores, block_max, k_cache, "
                "next_run, scale)\n")
_SOFTMAX_CALL = "        softmax_update(scores, n, block_max, running_max, running_sum, accs[i])\n"
_INTERLEAVE = ("                    mixed.append((builder.bitcast(builder.shuffle_vector(first, second, low), "
               "_BFLOATS),\n"
               "                                  builder.bitcast(builder.shuffle_vector(first, second, high), "
               "_BFLOATS)))\n")
_BLOCK_MAX = ("    for g in range(group):\n        top = np.float32(-np.inf)\n        for t in range(n):\n"
              "            top = max(top, scores[g, t])\n        block_max[g] = top\n")
_PREFETCH_CALL = ("        builder.call(fn, [pointer, i32(0), i32(2), i32(1)])  # locality 2: into L2, L1 stays for "
                  "the block\n")
_PREFETCH_ROW = ("def prefetch_row(cache, row_start, step):\n    for c in range(0, cache.shape[3], step):\n"
                 "        prefetch(cache, row_start + c)\n")


def _sparse_prefetch_row(every: int) -> str:
    """prefetch_row touching one cache line per `every` rows (the hardware streamer fetches the rest)."""
    return (f"def prefetch_row(cache, row_start, step):\n    if (row_start // cache.shape[3]) % {every} == 0:\n"
            "        prefetch(cache, row_start)\n")


# name -> [(old, new)]: each old text must occur exactly once in the package's sources, in one file.
VARIANTS = {
    "base": [],
    "pf0": [("PREFETCH_ROWS = 64 ", "PREFETCH_ROWS = 0 ")],
    "pf128": [("PREFETCH_ROWS = 64 ", "PREFETCH_ROWS = 128 ")],
    "pf256": [("PREFETCH_ROWS = 64 ", "PREFETCH_ROWS = 256 ")],
    "pf512": [("PREFETCH_ROWS = 64 ", "PREFETCH_ROWS = 512 ")],
    "no_values": [(_VALUES_CALL, "            pass\n")],
    "no_scores": [(_SCORES_CALL, "            pass\n")],
    "no_softmax": [(_SOFTMAX_CALL, "        pass\n")],
    "no_block_max": [(_BLOCK_MAX, "    block_max[0] = scores[0, 0]\n")],
    "pf_none": [(_PREFETCH_CALL, "")],
    "pf_t0": [(_PREFETCH_CALL, _PREFETCH_CALL.replace("i32(2)", "i32(3)"))],
    "pf_kb": [(_PREFETCH_ROW, _sparse_prefetch_row(4))],
    "pf_kb_far": [(_PREFETCH_ROW, _sparse_prefetch_row(4)), ("PREFETCH_ROWS = 64 ", "PREFETCH_ROWS = 256 ")],
    "pf_page": [(_PREFETCH_ROW, _sparse_prefetch_row(16))],
    "pf_page_far": [(_PREFETCH_ROW, _sparse_prefetch_row(16)), ("PREFETCH_ROWS = 64 ", "PREFETCH_ROWS = 256 ")],
    "widen": [("BF16_DOT = _use_bf16_dot()", "BF16_DOT = False")],
    "no_words": [('WORD_TILES = sys.byteorder == "little" and', "WORD_TILES = False and")],  # value by value
    "bf16_dot": [("BF16_DOT = _use_bf16_dot()", "BF16_DOT = host_has_bf16_dot()")],  # the vdpbf16ps path
    "base_again": [],  # the same code timed twice in one run: the run's own noise
    "v_interleaved": [(_INTERLEAVE, "                    mixed.append((builder.bitcast(first, _BFLOATS), "
                                    "builder.bitcast(second, _BFLOATS)))\n")],
}


def write_variant(name: str, directory: str, baseline: str | None = None) -> None:
    """directory/kernel_<name>/: the package (for the variant "baseline", `baseline`: a package directory or a git
    revision) with the variant's changes and its imports of itself renamed, so that variants import side by side."""
    target = Path(directory, f"kernel_{name}")
    if name == "baseline" and Path(baseline).is_dir():
        shutil.copytree(baseline, target, ignore=shutil.ignore_patterns("__pycache__"))
    elif name == "baseline":
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", baseline, PACKAGE], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
        Path(directory, PACKAGE).rename(target)
    else:
        shutil.copytree(ROOT / PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__"))
    sources = {path: path.read_text() for path in target.glob("*.py")}
    for old, new in VARIANTS.get(name, []):
        holders = [path for path, text in sources.items() if old in text]
        if len(holders) != 1 or sources[holders[0]].count(old) != 1:
            raise SystemExit(f"variant {name}: the package's sources no longer have this text exactly once:\n{old}")
        sources[holders[0]] = sources[holders[0]].replace(old, new)
    for path, text in sources.items():
        path.write_text(text.replace(f"from {PACKAGE}.", f"from kernel_{name}.")
                        .replace(f"from {PACKAGE} import", f"from kernel_{name} import"))


def import_variant(directory: str, name: str):
    """(decode_kernel, decode_layers) of variant `name` (an older package may define both in decode_kernel)."""
    sys.path.insert(0, directory)
    module = importlib.import_module(f"kernel_{name}.decode_kernel")
    if hasattr(module, "decode_layers"):
        return module.decode_kernel, module.decode_layers
    return module.decode_kernel, importlib.import_module(f"kernel_{name}.decode_layers").decode_layers


def random_bf16(count: int, rng) -> np.ndarray:
    """bfloat16 bit patterns of values in about +-[2**-15, 1): random sign, exponent and mantissa."""
    bits = rng.integers(0x3800, 0x3F80, size=count, dtype=np.uint16)
    return bits | (rng.integers(0, 2, size=count, dtype=np.uint16) << np.uint16(15))


def paged_inputs(length, kv_heads, q_heads, rotate_bytes, rng, batch=1):
    """Caches [blocks, Hkv, 64, 128] holding >= rotate_bytes, one shuffled block table [batch, L / 64] per
    rotation."""
    blocks = -(-length // BLOCK_SIZE)
    block_bytes = 2 * kv_heads * BLOCK_SIZE * HEAD_DIM * 2
    rotations = max(1, -(-rotate_bytes // (batch * blocks * block_bytes)))
    shape = (batch * blocks * rotations, kv_heads, BLOCK_SIZE, HEAD_DIM)
    k_cache = random_bf16(int(np.prod(shape)), rng).reshape(shape)
    v_cache = random_bf16(int(np.prod(shape)), rng).reshape(shape)
    order = rng.permutation(shape[0]).astype(np.int32)
    step = batch * blocks
    tables = [order[r * step:(r + 1) * step].reshape(batch, blocks).copy() for r in range(rotations)]
    q = random_bf16(batch * q_heads * HEAD_DIM, rng).reshape(batch, q_heads, HEAD_DIM)
    return q, k_cache, v_cache, tables, np.full(batch, length, np.int32)


def time_kernel(kernel, q, k_cache, v_cache, tables, lens, threads, repeats):
    """Median seconds of one kernel call, cycling through the block tables."""
    out = np.empty(q.shape, np.float32)
    lse = np.empty(q.shape[:2], np.float32)
    calls = [lambda t=t: kernel(q, k_cache, v_cache, t, lens, 0.088, 0, threads, out, lse) for t in tables]
    return median_seconds(calls, repeats)


def time_lane(decode_layers, layers, batch, context, threads, rng) -> dict:
    """A whole host-lane step as the engine runs it: decode_layers over every layer, gates open, at Hq 16 and 32
    (GB/s of KV read, median of 3)."""
    blocks = -(-context // BLOCK_SIZE)
    shape = (layers, 2, batch * blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    pools = random_bf16(int(np.prod(shape)), rng).reshape(shape)
    tables = rng.permutation(batch * blocks).astype(np.int32).reshape(batch, blocks)
    lens = np.full(batch, context, np.int32)
    slots = np.full(batch, -1, np.int64)  # no new token: the step reads what is there
    new = random_bf16(layers * batch * KV_HEADS * HEAD_DIM, rng).reshape(layers, batch, KV_HEADS, HEAD_DIM)
    result = {}
    for q_heads in (16, 32):
        q = random_bf16(layers * batch * q_heads * HEAD_DIM, rng).reshape(layers, batch, q_heads, HEAD_DIM)
        out = np.empty(q.shape, np.float32)
        lse = np.empty(q.shape[:3], np.float32)

        def step():
            gates = np.zeros((2, layers), np.int32)
            gates[0] = 1  # every layer handed over: the step runs without a device
            error = decode_layers(gates, np.zeros(2, np.int64), q, new, new, pools, slots, tables, lens, batch, 0.088,
                                  threads, out, lse, np.zeros((layers + 1, 2), np.int64))
            assert error == 0, error

        result[f"lane_hq{q_heads}_gbps"] = pools.nbytes / median_seconds([step], 3, warmup=1) / GB
    return result


def run_variant(directory: str, name: str, threads: int, length: int, rotate_gb: float, batches, lane) -> dict:
    """In a subprocess: the variant's rates at Hq 16 and 32 (batches: more B x L cases, on all threads only;
    lane: (layers, batch, context) of a decode_layers step, or None)."""
    import numba

    kernel, decode_layers = import_variant(directory, name)
    rng = np.random.default_rng(0)
    rows = {}
    for q_heads in (16, 32):
        row = {}
        numba.set_num_threads(threads)
        case = paged_inputs(length, KV_HEADS, q_heads, int(rotate_gb * GB), rng)
        nbytes = 2 * length * KV_HEADS * HEAD_DIM * 2
        row["dram_ms"] = time_kernel(kernel, *case, threads, 7) * 1e3
        row["dram_gbps"] = nbytes / row["dram_ms"] / 1e6
        numba.set_num_threads(1)
        row["dram1_ms"] = time_kernel(kernel, *case, 1, 3) * 1e3
        row["dram1_gbps"] = nbytes / row["dram1_ms"] / 1e6
        del case
        q, k_cache, v_cache, tables, lens = paged_inputs(CACHED_BLOCKS * BLOCK_SIZE, 1, q_heads // KV_HEADS, 0, rng)
        table = np.tile(tables[0], (1, length // BLOCK_SIZE // CACHED_BLOCKS))  # the same blocks again and again
        nbytes = 2 * length * HEAD_DIM * 2
        row["cache1_ms"] = time_kernel(kernel, q, k_cache, v_cache, [table], np.array([length], np.int32), 1, 5) * 1e3
        row["cache1_gbps"] = nbytes / row["cache1_ms"] / 1e6
        numba.set_num_threads(threads)
        for batch, context in batches:
            case = paged_inputs(context, KV_HEADS, q_heads, int(rotate_gb * GB), rng, batch)
            nbytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
            row[f"dram_{batch}x{context}_gbps"] = nbytes / time_kernel(kernel, *case, threads, 7) / GB
            del case
        rows[f"hq{q_heads}"] = row
    if lane:
        numba.set_num_threads(threads)
        rows["lane"] = time_lane(decode_layers, *lane, threads, rng)
    return rows


def paged_read(threads: int, length: int, rotate_gb: float) -> dict:
    """In a subprocess: a plain sum over the same paged K and V, block by block, ~8 items a thread, one kv head an
    item or all of a block's heads in a row ("heads"), without and with a one-block-ahead software prefetch:
    what the layout and the memory system allow without the kernel's arithmetic (GB/s, all threads and one)."""
    import numba
    from numba import njit, prange

    from cpu_attention.llvm_ops import prefetch as prefetch_line

    @njit(parallel=True, nogil=True)
    def sum_blocks(k_cache, v_cache, table, chunk, item_heads, workers, prefetch):
        num_blocks, kv_heads = table.shape[0], k_cache.shape[1]
        words = k_cache.shape[2] * k_cache.shape[3]
        k_flat = k_cache.reshape(k_cache.shape[0] * kv_heads, words)
        v_flat = v_cache.reshape(v_cache.shape[0] * kv_heads, words)
        head_runs = kv_heads // item_heads
        items = (num_blocks + chunk - 1) // chunk * head_runs
        totals = np.zeros((workers, 16), np.uint64)
        for w in prange(workers):
            total = np.uint64(0)
            for item in range(w, items, workers):
                h0, first = item % head_runs * item_heads, item // head_runs * chunk
                last = min(first + chunk, num_blocks)
                for j in range(first, last):
                    for h in range(h0, h0 + item_heads):
                        run = table[j] * kv_heads + h
                        if prefetch and j + 1 < last:
                            ahead = (table[j + 1] * kv_heads + h) * words
                            for c in range(0, words, 32):
                                prefetch_line(k_cache, ahead + c)
                                prefetch_line(v_cache, ahead + c)
                        for x in range(words):
                            total += k_flat[run, x]
                        for x in range(words):
                            total += v_flat[run, x]
            totals[w, 0] = total
        return totals

    rng = np.random.default_rng(1)
    _, k_cache, v_cache, tables, _ = paged_inputs(length, KV_HEADS, KV_HEADS, int(rotate_gb * GB), rng)
    nbytes = 2 * length * KV_HEADS * HEAD_DIM * 2
    per_item = max(4, -(-tables[0].shape[1] * KV_HEADS // (threads * 8)))  # block-heads an item, as plan_work
    result = {}
    for count in (threads, 1):
        numba.set_num_threads(count)
        for item_heads, prefetch in ((1, False), (1, True), (KV_HEADS, False), (KV_HEADS, True)):
            reads = [lambda t=t: sum_blocks(k_cache, v_cache, t[0], -(-per_item // item_heads), item_heads, count,
                                            prefetch) for t in tables]
            label = (f"paged_read_{'all' if count > 1 else 'one'}{'_heads' if item_heads > 1 else ''}"
                     f"{'_prefetch' if prefetch else ''}_gbps")
            result[label] = nbytes / median_seconds(reads, 6 if count > 1 else 2, warmup=1) / GB
    return result


def ceilings(threads: int, gigabytes: float) -> dict:
    """The host read ceiling (bench_cpu_attention's parallel sum) on all threads and on one (GB/s)."""
    import numba

    result = {}
    for label, count in (("all", threads), ("one", 1)):
        numba.set_num_threads(count)
        result[f"read_{label}_gbps"] = read_ceiling_gbps(gigabytes, repeats=3)
    return result


def write_result(path: str | None, result: dict) -> None:
    """The run's JSON at path (its folder made), if a path was given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=14)
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--rotate-gb", type=float, default=1.0)
    parser.add_argument("--ceiling-gb", type=float, default=2.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--lane", default="", help="LxBxC: also time decode_layers, L layers of B x C (36x32x2048)")
    parser.add_argument("--batches", default="", help="more BxL cases timed on all threads, e.g. 32x2048")
    parser.add_argument("--baseline", default=None,
                        help="a git revision, or a copy of the cpu_attention directory, timed as 'baseline'")
    parser.add_argument("--child", nargs=2, metavar=("DIR", "NAME"), help=argparse.SUPPRESS)
    parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--paged-read", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.paged_read:
        print(json.dumps(paged_read(args.threads, args.length, args.rotate_gb)))
        return
    if args.child:
        directory, name = args.child
        if args.compile_only:
            kernel, _ = import_variant(directory, name)
            case = paged_inputs(256, 1, 4, 0, np.random.default_rng(0))
            time_kernel(kernel, *case, 1, 1)
            return
        batches = [tuple(int(x) for x in case.split("x")) for case in args.batches.split(",") if case]
        lane = tuple(int(x) for x in args.lane.split("x")) if args.lane else None
        print(json.dumps(run_variant(directory, name, args.threads, args.length, args.rotate_gb, batches, lane)))
        return

    names = (["baseline"] if args.baseline else []) + args.variants.split(",")
    directory = tempfile.mkdtemp(prefix="host_kernel_variants_")
    for name in names:
        write_variant(name, directory, args.baseline)
    env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(directory, "cache"))
    command = [sys.executable, __file__, "--threads", str(args.threads), "--length", str(args.length),
               "--rotate-gb", str(args.rotate_gb), "--batches", args.batches, "--lane", args.lane]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(len(names), os.cpu_count() or 1)) as pool:
        list(pool.map(lambda n: subprocess.run(command + ["--child", directory, n, "--compile-only"], env=env,
                                               check=True), names))
    print(f"compiled {len(names)} variants in {time.perf_counter() - start:.0f} s", flush=True)
    import numba

    numba.set_num_threads(args.threads)
    result = {"threads": args.threads, "length": args.length, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
              "block_size": BLOCK_SIZE, **ceilings(args.threads, args.ceiling_gb), "variants": {}}
    print(f"read ceiling: {result['read_all_gbps']:.1f} GB/s on {args.threads} threads, "
          f"{result['read_one_gbps']:.1f} on one", flush=True)
    done = subprocess.run(command + ["--paged-read"], env=env, check=True, capture_output=True, text=True)
    result.update(json.loads(done.stdout.strip().splitlines()[-1]))
    reads = [f"{k[11:-5]} {v:.1f}" for k, v in result.items() if k.startswith("paged_read")]
    print("paged plain read: " + ", ".join(reads) + " GB/s", flush=True)
    for name in names:
        done = subprocess.run(command + ["--child", directory, name], env=env, check=True, capture_output=True,
                              text=True)
        rows = json.loads(done.stdout.strip().splitlines()[-1])
        result["variants"][name] = rows
        if "lane" in rows:
            lane = rows["lane"]
            print(f"{name:>14} decode_layers {args.lane}: " + ", ".join(
                f"Hq {k[7:9]} {v:.1f} GB/s ({v / result['read_all_gbps']:.2f})" for k, v in lane.items()), flush=True)
        for heads, row in ((k, v) for k, v in rows.items() if k.startswith("hq")):
            print(f"{name:>14} {heads}: dram {row['dram_ms']:7.2f} ms {row['dram_gbps']:6.1f} GB/s "
                  f"({row['dram_gbps'] / result['read_all_gbps']:.2f} of ceiling) | one thread: dram "
                  f"{row['dram1_gbps']:5.1f} GB/s, in cache {row['cache1_gbps']:5.1f} GB/s"
                  + "".join(f" | {k[5:-5]} {v / result['read_all_gbps']:.2f}" for k, v in row.items()
                            if k.startswith("dram_") and k.count("x")), flush=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
