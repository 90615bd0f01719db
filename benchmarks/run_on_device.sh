#!/usr/bin/env bash
# One device call = one stage of checks and benchmarks; every result lands in $OUT (or benchmarks/results).
# Usage: bash benchmarks/run_on_device.sh STAGE
#   check, engine, tiers, gpu-bench, cpu-bench, suite-ac, suite-c, suite-b-small, suite-b-8b, suite-ac-8b,
#   suite-dh-small, suite-dh-8b, engine-step, kv-store, lanes, startup-load, host-kernel-paired, placement-mixed,
#   placement-ab, long-context-c, long-context-c256, long-context-c512, long-context-c512-peer, long-context-8b, long-context-profile, step-ab, test-gpu-shards, weight-check,
#   flash-attn-install, flash-attn, flash-attn-bench, flash-attn-rounds, tp-and-backends, multi-gpu, multi-gpu-tp, multi-gpu-steps,
#   tp-all-reduce, tests-multi-gpu, tp-check, tp-two-gpus, decode-tiles, skinny-gemm, skinny-step,
#   long-context-8b-decode, long-context-8b-parts, suite-guarantee-small, suite-guarantee-8b
# The offload suite runs in five calls (suite-ac, suite-b-small, suite-b-8b, suite-dh-small, suite-dh-8b), its
# guarantee alone (auto against gpu) in two (suite-guarantee-small, suite-guarantee-8b); then, here:
#   python -m benchmarks.report benchmarks/results/<device>
set -u
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
# flash-attn 4, where an earlier call of this machine installed it (stage flash-attn-install)
[ -d /tmp/site/flash_attn ] && export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
step() {  # step NAME SECONDS CMD...: runs one step under a time limit, logging to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "--- $name exit $?"
  tail -n 25 "$OUT/$name.log"
}
case "${1:-check}" in
  check)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g | head -2
      python3 -c "import torch, triton, numba, transformers; print(torch.__version__, triton.__version__, numba.__version__, transformers.__version__)"
      lscpu | grep -E "Model name|Flags" | cut -c1-200; } > "$OUT/env.txt" 2>&1; cat "$OUT/env.txt"
    step kernels 200 python3 benchmarks/check_gpu_kernels.py --out "$OUT/gpu_kernel_check.json"
    step throughput 240 python3 benchmarks/bench_throughput.py single --model qwen3-0.6b --num-seqs 64 --prompt-len 512 \
      --output-len 128 --kv-placement gpu --out "$OUT/throughput_qwen3-0.6b_b64.json"
    ;;
  engine)
    for placement in gpu; do
      step throughput_$placement 200 python3 benchmarks/bench_throughput.py single --model qwen3-0.6b --num-seqs 64 \
        --prompt-len 512 --output-len 128 --kv-placement $placement --cpu-kv-cache-gb 8 --max-num-seqs 64 \
        --out "$OUT/throughput_qwen3-0.6b_b64_$placement.json"
    done
    ;;
  suite-ac)  # workloads a and c of the offload suite
    step suite_ac 450 python3 benchmarks/bench_throughput.py --profile full --workloads ac --out-dir "$OUT"
    ;;
  suite-c)  # workload c alone (split, host only, device only, at 262k and at 1.5x the budget; ~4-5 min)
    step suite_c 570 python3 benchmarks/bench_throughput.py --profile full --workloads c --out-dir "$OUT"
    ;;
  suite-ac-8b)  # suite-ac and suite-b-8b in one call (one machine start), with shorter limits; b 8B's third
    # budget (a 24 GiB card's) adds ~1 min, which 300 s may not hold: prefer suite-ac and suite-b-8b
    step suite_ac 200 python3 benchmarks/bench_throughput.py --profile full --workloads ac --out-dir "$OUT"
    step suite_b_8b 300 python3 benchmarks/bench_throughput.py --profile full --workloads b --b-names b \
      --b-models qwen3-8b --out-dir "$OUT"
    ;;
  suite-b-small)
    step suite_b_small 570 python3 benchmarks/bench_throughput.py --profile full --workloads b --b-names b \
      --b-models qwen3-0.6b --out-dir "$OUT"
    ;;
  suite-b-8b)
    step suite_b_8b 570 python3 benchmarks/bench_throughput.py --profile full --workloads b --b-names b \
      --b-models qwen3-8b --out-dir "$OUT"
    ;;
  suite-dh-small)  # decode-heavy 0.6B: gpu and auto at 1/4 and 1/8, cpu once, no peers (~5 min estimated)
    step suite_dh_small 570 python3 benchmarks/bench_throughput.py --profile full --workloads b --b-names dh \
      --b-models qwen3-0.6b --out-dir "$OUT"
    ;;
  suite-guarantee-small|suite-guarantee-8b)  # the suite's guarantee alone (auto against gpu at every b and dh point
    # of one model size), no cpu placement, no peers: one call where the full parts take two. It writes
    # offload_full_b-<model>-dh-<model>.json: report.py merges every offload_full_*.json of a folder, so the same
    # points' older parts there (offload_full_b-<model>.json, ..._dh-<model>.json) leave it when this lands.
    # ROUNDS=2: gpu and auto in turns twice at each point, each keeping its faster (0.6B: ~5 min)
    model=qwen3-0.6b; [ "$1" = suite-guarantee-8b ] && model=qwen3-8b
    step "${1//-/_}" 570 python3 benchmarks/bench_throughput.py --profile full --workloads b --b-names b,dh \
      --b-models $model --no-peers --no-cpu --rounds ${ROUNDS:-1} --out-dir "$OUT"
    ;;
  suite-dh-8b)  # decode-heavy 8B: gpu and auto at a 24 GiB card's KV room and at 1/8, no cpu, no peers (~4-5 min)
    step suite_dh_8b 570 python3 benchmarks/bench_throughput.py --profile full --workloads b --b-names dh \
      --b-models qwen3-8b --out-dir "$OUT"
    ;;
  engine-step)  # a decode step against its graph and the HBM bound, 256 mixed prompts, workload a (~8 min with HF)
    step engine_step 570 python3 benchmarks/bench_engine_step.py --out-dir "$OUT"
    ;;
  kv-store)  # what the K/V store inside the rotation's kernel pays (on by default, layers/fused.py): the step grid
    # with it and without it, side by side in one process
    step kv_store_off 500 python3 benchmarks/bench_engine_step.py --unfused --unfused-kernels kv_store --skip-hf \
      --skip-a --batches 1,4,16,64,256 --contexts 512,2048 --out-dir "$OUT/kv_store_off"
    ;;
  lanes)  # the device lane's step with a host step in flight against idle, as the engine runs (async scheduling)
    step lanes_8b 280 python3 benchmarks/bench_lane_interference.py --model qwen3-8b --device-seqs 24 --host-seqs 24 \
      --host-prompt 1536 --output 160 --async-scheduling --out "$OUT/lane_interference_8b.json"
    step lanes_06b 280 python3 benchmarks/bench_lane_interference.py --model qwen3-0.6b --device-seqs 10,32 \
      --host-seqs 32 --host-prompt 2048 --output 160 --async-scheduling --out "$OUT/lane_interference_06b.json"
    ;;
  startup-load)  # start-up with a 32 GiB host pool (first and warm), then 10,000 mixed requests through one engine
    step startup 200 python3 benchmarks/bench_startup.py --cpu-kv-cache-gb 32 --out "$OUT/startup.json"
    step load 420 python3 benchmarks/bench_load.py --profile full --out "$OUT/load.json"
    ;;
  host-kernel-paired)  # the host kernel at 1 x 128k: each round against the ceiling read right before it
    for H in 32 16; do
      step cpu_attention_paired_hq$H 270 python3 benchmarks/bench_cpu_attention.py --cases 1x131072,8x16384 \
        --q-heads $H --threads 14 --no-sdpa --no-sweep --paired 9 --tag paired \
        --out "$OUT/cpu_attention_1x128k_paired_hq$H.json"
    done
    ;;
  placement-mixed)  # off the suite: mixed lengths (each uniform in L x [1 - spread, 1 + spread]), gpu then
    # auto, by default at the points the replay (simulate_placement.py --mixed) put lowest and at decode-heavy 8B at a
    # 24 GB card's room. MIXED_POINTS: "model seqs prompt output blocks host_gb max_model_len spread; ..."
    IFS=';' read -ra points <<< "${MIXED_POINTS:-qwen3-8b 32 4096 128 1056 44 6336 0.5; qwen3-0.6b 64 2048 256 2304 24 3456 0.5;
      qwen3-8b 64 1024 1024 3296 44 3072 0.5}"
    for point in "${points[@]}"; do
      set -- $point
      for placement in gpu auto; do
        name=mixed_$1_$2x$3-$4_s$8_$5_$placement
        step $name 240 python3 benchmarks/bench_throughput.py single --model $1 --num-seqs $2 --prompt-len $3 \
          --output-len $4 --spread $8 --num-gpu-blocks $5 --cpu-kv-cache-gb $6 --max-model-len $7 \
          --kv-placement $placement --out "$OUT/$name.json"
      done
    done
    ;;
  placement-ab)  # runs side by side in one call, each "placement" or "placement:NAME=VALUE[,NAME=VALUE]"
    # (bench_throughput.py --set-placement), at each point of AB_POINTS: "model seqs prompt output blocks host_gb
    # max_model_len; ...". A run repeated gets _r2, _r3... E.g. AB_RUNS="gpu auto auto:PROMOTION_HOLD_STEPS=0"
    IFS=';' read -ra points <<< "${AB_POINTS:-qwen3-8b 48 2048 512 2560 44 2560}"
    for point in "${points[@]}"; do
      set -- $point
      for run in ${AB_RUNS:-gpu auto auto}; do
        placement=${run%%:*}; sets=(); label=$placement
        if [[ $run == *:* ]]; then
          IFS=',' read -ra assignments <<< "${run#*:}"
          for a in "${assignments[@]}"; do sets+=(--set-placement "$a"); label+=_${a/=/-}; done
        fi
        base=ab_$1_$2x$3-$4_$5_$label; name=$base; k=1
        while [ -e "$OUT/$name.json" ]; do k=$((k + 1)); name=${base}_r$k; done
        step $name 300 python3 benchmarks/bench_throughput.py single --model $1 --num-seqs $2 --prompt-len $3 \
          --output-len $4 --num-gpu-blocks $5 --cpu-kv-cache-gb $6 --max-model-len $7 --kv-placement $placement \
          "${sets[@]}" --out "$OUT/$name.json"
      done
    done
    ;;
  long-context-c)  # one 262,144-token context (0.6B shape): auto with and without streaming, cpu, transformers
    # offloaded, against the ceilings measured first (bench_long_context.py, within --deadline-s 540); LC_FLAGS:
    # e.g. --skip-peer
    step long_context_c 570 python3 -m benchmarks.bench_long_context --workload c --out-dir "$OUT" ${LC_FLAGS:-}
    ;;
  long-context-c256)  # c with 256 new tokens (workload c256): auto with and without streaming and transformers
    # offloaded (given the time to finish), no cpu run (~8-9 min)
    step long_context_c256 590 python3 -m benchmarks.bench_long_context --workload c256 --skip-cpu --deadline-s 580 \
      --out-dir "$OUT" ${LC_FLAGS:-}
    ;;
  long-context-c512)  # c with 512 new tokens: auto with and without streaming, no cpu run, no peer (~6-7 min);
    # then long-context-c512-peer on the same warm host, with this call's long_context.json copied into the tree
    step long_context_c512 590 python3 -m benchmarks.bench_long_context --workload c512 --skip-cpu --skip-peer \
      --deadline-s 580 --out-dir "$OUT" ${LC_FLAGS:-}
    ;;
  long-context-c512-peer)  # transformers' offloaded cache on c512's prompt (~7-8 min), for the entry in $ENTRY (the
    # long_context.json of long-context-c512's call on this host, carried in the tree); writes it with the peer
    step long_context_c512_peer 595 python3 -m benchmarks.bench_long_context --workload c512 --peer-only "$ENTRY" \
      --deadline-s 590 --out-dir "$OUT"
    ;;
  long-context-8b)  # 8B shape, 8 x (32,768 + 256) at a 24 GB card's 3,296 blocks: the same runs; the cpu run is
    # skipped (and recorded) when too little time is left, the peer takes what is left, from batch 4: at batch 8 it
    # was OOM-killed on the 125 GiB H200 host at 79fa2b8 and a3af41d, after ~100 s of the call (recorded as not
    # attempted). LC_FLAGS: e.g. --skip-cpu
    step long_context_8b 570 python3 -m benchmarks.bench_long_context --workload batch8b --peer-batches 4,2,1 \
      --out-dir "$OUT" ${LC_FLAGS:-}
    ;;
  long-context-8b-parts)  # issue 59: batch8b with promotion in parts off and on, in turns, two rounds, in one process
    # (OFFLOAD_ENGINE_PROMOTE_IN_PARTS; docs/decisions/placement.md, "Promotion in parts"); streaming on (~4-5 min)
    step long_context_8b_parts 420 python3 -m benchmarks.ab_long_context --workload batch8b --rounds 2 \
      --env OFFLOAD_ENGINE_PROMOTE_IN_PARTS --values 0,1 --deadline-s 400 --out "$OUT/ab_promote_in_parts.json"
    ;;
  long-context-profile)  # where long contexts lose time (issue 59, items 3 and 4): batch8b's auto with and without
    # streaming (host steps split into kernel work, device waits and the rest), then the prefill's parts of c and
    # batch8b (profile_prefill.py) against their bounds
    step long_context_8b 280 python3 -m benchmarks.bench_long_context --workload batch8b --out-dir "$OUT" --skip-peer \
      --skip-cpu --deadline-s 270
    step prefill_c 170 python3 -m benchmarks.profile_prefill --workload c --out "$OUT/prefill_profile_c.json"
    step prefill_8b 75 python3 -m benchmarks.profile_prefill --workload batch8b --out "$OUT/prefill_profile_batch8b.json"
    step prefill_8b_cpu 70 python3 -m benchmarks.profile_prefill --workload batch8b --placement cpu \
      --out "$OUT/prefill_profile_batch8b_cpu.json"
    ;;
  step-ab)  # the decode step now against an earlier checkout ($OLD, e.g. a git worktree carried in an ignored
    # folder), one after the other on this machine: whether a change slowed the step for requests that use none of it
    for side in old new; do
      dir=$PWD; [ $side = old ] && dir=${OLD:?set OLD to the earlier checkout}
      (cd "$dir" && PYTHONPATH="$dir" step engine_step_$side 280 python3 -m benchmarks.bench_engine_step --skip-hf \
        --skip-a --batches 1,16,64,256 --contexts 512,2048 --out-dir "$OUT/engine_step_$side")
    done
    ;;
  test-gpu-shards)  # make test-gpu in one call on a host of several GPUs: one pytest per GPU, each on its own cores,
    # the files dealt out by size; outputs concatenated into $OUT/gpu_tests.txt. SHARD_GPUS: use only the first
    # N GPUs (and their cores), leaving the others to a benchmark run beside the tests; SHARD_FIRST_GPU: start at this
    # GPU (and its cores) instead, with no shard of several GPUs; SHARD_MULTI_GPU=0: no shard of several GPUs
    # either (their tests then skip in the one-GPU shards); GPU_TESTS: the output's name
    # (gpu_tests_flash_attn with OFFLOAD_ENGINE_ATTENTION_BACKEND=flash-attn); SHARDS_PER_GPU: pytest processes per
    # GPU, the GPU's cores split among them. A test that runs past 240 s dumps every thread's stack into the output
    # (pytest's faulthandler_timeout), so a hang names itself even when the shard's time limit then ends it.
    make --no-print-directory install > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }; rm "$OUT/install.log"
    all=$(nvidia-smi -L | wc -l); gpus=${SHARD_GPUS:-$all}; per=${SHARDS_PER_GPU:-1}; shards=$((gpus * per))
    cores=$(( $(nproc) / all / per )); first=${SHARD_FIRST_GPU:-0}
    [ "$first" -gt 0 ] || [ "${SHARD_MULTI_GPU:-1}" = 0 ] && all=1  # no shard of two GPUs
    # Tests of several GPUs (tensor parallelism, prefill/decode separation) get a shard of their own that sees two
    # GPUs (shared with the first shards) where the host has them; the rest are dealt out by their seconds.
    files=$(ls tests/*.py tests/*/*.py tests/*/*/*.py 2>/dev/null | grep "/test_")
    [ "$all" -ge 2 ] && files=$(echo "$files" | grep -v -e tests/distributed/ -e tests/engine/disagg/)
    # dealt by the seconds each file took last time (benchmarks/deal_tests.py; the run writes them anew)
    .venv/bin/python -m benchmarks.deal_tests $shards benchmarks/results/gpu_test_seconds.json $files |
      { g=0; while read -r line; do echo "$line" | tr ' ' '\n' > "$OUT/shard_$g.txt"; g=$((g + 1)); done; }
    if [ "$all" -ge 2 ]; then
      ls tests/distributed/test_*.py tests/engine/disagg/test_*.py > "$OUT/shard_$shards.txt"
      CUDA_VISIBLE_DEVICES=0,1 NUMBA_NUM_THREADS=$cores OFFLOAD_ENGINE_TEST_DEVICE=cuda timeout ${SHARD_LIMIT:-560} \
        .venv/bin/python -m pytest -v -rs --durations=5 -o faulthandler_timeout=240 --junitxml="$OUT/junit_$shards.xml" $(cat "$OUT/shard_$shards.txt") > "$OUT/gpu_tests_shard_$shards.txt" 2>&1 &
    fi
    for g in $(seq 0 $((shards - 1))); do
      grep -q . "$OUT/shard_$g.txt" 2>/dev/null || { echo "(no files)" > "$OUT/gpu_tests_shard_$g.txt"; continue; }
      c=$(( (first * per + g) * cores ))
      CUDA_VISIBLE_DEVICES=$((first + g % gpus)) NUMBA_NUM_THREADS=$cores OFFLOAD_ENGINE_TEST_DEVICE=cuda \
        taskset -c $c-$((c + cores - 1)) timeout ${SHARD_LIMIT:-560} .venv/bin/python -m pytest -q -rs \
        --durations=5 -o faulthandler_timeout=240 --junitxml="$OUT/junit_$g.xml" $(cat "$OUT/shard_$g.txt") > "$OUT/gpu_tests_shard_$g.txt" 2>&1 &
    done
    wait; gpus=$shards; [ "$all" -ge 2 ] && gpus=$((shards + 1))
    { echo "# make test-gpu in $gpus shards ($per per GPU), $(date -u '+%F %H:%M') UTC, commit ${BENCH_COMMIT:-?}, backend ${OFFLOAD_ENGINE_ATTENTION_BACKEND:-auto}, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
      for g in $(seq 0 $((gpus - 1))); do echo "## shard $g: $(tr '\n' ' ' < "$OUT/shard_$g.txt")"; cat "$OUT/gpu_tests_shard_$g.txt"; done
    } > "$OUT/${GPU_TESTS:-gpu_tests}.txt"; grep -h "passed\|failed" "$OUT"/gpu_tests_shard_*.txt; rm -f "$OUT"/shard_*.txt "$OUT"/gpu_tests_shard_*.txt
    .venv/bin/python -m benchmarks.deal_tests --seconds "$OUT"/junit_*.xml > "$OUT/gpu_test_seconds.json"; rm -f "$OUT"/junit_*.xml
    ;;
  decode-tiles)  # the paged decode kernel's tiles and split counts against the HBM copy rate (issue 59: the device
    # lane's batch-1 attention of a long-context batch read 0.77 of it on the H200 host; ~2-3 min)
    step decode_tiles ${DECODE_TILES_LIMIT:-500} python3 -m benchmarks.sweep_decode_tiles --out "$OUT/decode_tiles.json"
    ;;
  long-context-8b-decode)  # issue 59 on one GPU: batch8b's decode alone, streaming on and off (no cpu run, no peer:
    # both measured at 217dfeb), ~2.5 min
    step long_context_8b 200 python3 -m benchmarks.bench_long_context --workload batch8b --skip-peer --skip-cpu \
      --deadline-s 190 --out-dir "$OUT"
    ;;
  skinny-step)  # the skinny projections at every shape (default tiles), then the decode step with them and without
    # them (bench_engine_step --unfused-kernels skinny_gemm): 8B at 1k and 32k, 0.6B at 2k
    step skinny_gemm 60 python3 -m benchmarks.bench_skinny_gemm --out "$OUT/skinny_gemm.json"
    step step_skinny_8b 200 python3 -m benchmarks.bench_engine_step --model qwen3-8b --skip-hf --skip-a \
      --skip-throughput --batches 1,16 --contexts 1024,32768 --unfused --unfused-kernels skinny_gemm \
      --model-cache /tmp/models_skinny_step --out-dir "$OUT/engine_step_skinny_8b"
    step step_skinny_06b 120 python3 -m benchmarks.bench_engine_step --skip-hf --skip-a --skip-throughput \
      --batches 1,16,64 --contexts 2048 --unfused --unfused-kernels skinny_gemm --model-cache /tmp/models_skinny_step \
      --out-dir "$OUT/engine_step_skinny_06b"
    ;;
  skinny-gemm)  # issue 59: decode's projections, torch's GEMM against gpu_kernels/skinny_gemm.py at the 8B's shapes
    # (whole and halved by TP=2), every tile setting at 1 and 16 rows
    step skinny_gemm 300 python3 -m benchmarks.bench_skinny_gemm --sweep --out "$OUT/skinny_gemm.json"
    ;;
  weight-check)  # what the load-time NaN/infinity check of the weights costs at the 8B shape (bench_weight_check.py)
    step weight_check 240 python3 benchmarks/bench_weight_check.py --model qwen3-8b --out "$OUT/weight_check.json"
    ;;
  flash-attn-install)  # flash-attn 4 (../shared/tools/flash_attn4_wheels.sh fills .fa4a and .fa4b here): a first
    # call carrying .fa4a copies its archive to /tmp/fa4; this stage, carrying .fa4b, installs into /tmp/site
    [ -f /tmp/fa4/cu13.tar.xz ] || { mkdir -p /tmp/fa4 && cp .fa4a/cu13.tar.xz /tmp/fa4/ && echo "copied" && exit 0; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .fa4b/*.whl &&
      (cd /tmp/site && xz -dc /tmp/fa4/cu13.tar.xz | tar -x) && echo "installed" || exit 1
    ;;
  flash-attn)  # issue 62, once installed: the backend's tests, the engine's on the GPU (auto prefills on flash-attn
    # 4), and the kernels side by side (bench_gpu_attention.py)
    python3 -c "import flash_attn.cute.interface" || exit 1
    step fa4_tests 300 env OFFLOAD_ENGINE_TEST_DEVICE=cuda python3 -m pytest -q -rs tests/layers \
      tests/engine/test_placements.py tests/engine/test_split_sequences.py tests/engine/runner/test_prefill_segments.py
    step gpu_attention 280 python3 benchmarks/bench_gpu_attention.py --out-dir "$OUT"
    ;;
  flash-attn-bench)  # issue 62 on a host of four GPUs, one group per GPU and its cores, in parallel: the kernels side
    # by side (bench_gpu_attention), the engine per backend (bench_backends: 0.6B cases, then 8B cases) and c's
    # prefill per backend (profile_prefill); every comparison runs within one group, on one GPU
    cores=$(( $(nproc) / 4 ))
    group() {  # group GPU NAME CMD...
      local g=$1 name=$2; shift 2
      CUDA_VISIBLE_DEVICES=$g NUMBA_NUM_THREADS=$cores taskset -c $((g * cores))-$(((g + 1) * cores - 1)) \
        timeout 540 "$@" > "$OUT/$name.log" 2>&1; echo "--- $name exit $?"; tail -n 12 "$OUT/$name.log"; rm "$OUT/$name.log"
    }
    group 0 gpu_attention python3 benchmarks/bench_gpu_attention.py --out-dir "$OUT" &
    group 1 backends_small python3 -m benchmarks.bench_backends --cases b-0.6b-gpu,b-0.6b-auto-quarter,long-prompts-0.6b-gpu \
      --out "$OUT/backends_engine_0.6b.json" &
    group 2 backends_8b python3 -m benchmarks.bench_backends --cases b-8b-gpu,b-8b-auto-quarter \
      --out "$OUT/backends_engine_8b.json" &
    group 3 prefill_c bash -c 'for b in triton flash-attn; do OFFLOAD_ENGINE_ATTENTION_BACKEND=$b python3 -m \
      benchmarks.profile_prefill --workload c --out "$OUT/prefill_profile_c_$b.json" | tail -n 3; done' &
    wait
    ;;
  flash-attn-rounds)  # bench_backends' case where placements vary run to run (auto at 1/4), in rounds, beside the
    # 0.6B's plain b on another GPU
    cores=$(( $(nproc) / 4 ))
    for g in 0 1; do
      case_=$([ $g = 0 ] && echo b-0.6b-auto-quarter || echo b-0.6b-gpu,long-prompts-0.6b-gpu)
      CUDA_VISIBLE_DEVICES=$g NUMBA_NUM_THREADS=$cores taskset -c $((g * cores))-$(((g + 1) * cores - 1)) timeout 400 \
        python3 -m benchmarks.bench_backends --cases $case_ --rounds 3 --out "$OUT/backends_engine_rounds_$g.json" \
        > "$OUT/rounds_$g.log" 2>&1 &
    done
    wait; tail -n 30 "$OUT"/rounds_*.log; rm "$OUT"/rounds_*.log
    ;;
  tp-and-backends)  # a host of four GPUs, three groups at once: TP's step ratio per rank and greedy agreement on
    # GPUs 0-1 (multi-gpu-steps), the engine per attention backend on GPU 2 (0.6B cases) and GPU 3 (8B cases)
    cores=$(( $(nproc) / 4 ))
    (CUDA_VISIBLE_DEVICES=0,1 taskset -c 0-$((2 * cores - 1)) bash "$0" multi-gpu-steps > "$OUT/tp_group.log" 2>&1) &
    for g in 2 3; do
      cases=$([ $g = 2 ] && echo b-0.6b-gpu,b-0.6b-auto-quarter,long-prompts-0.6b-gpu || echo b-8b-gpu,b-8b-auto-quarter)
      CUDA_VISIBLE_DEVICES=$g NUMBA_NUM_THREADS=$cores taskset -c $((g * cores))-$(((g + 1) * cores - 1)) timeout 540 \
        python3 -m benchmarks.bench_backends --cases $cases --rounds $([ $g = 2 ] && echo 3 || echo 1) \
        --out "$OUT/backends_engine_$g.json" > "$OUT/backends_$g.log" 2>&1 &
    done
    wait; tail -n 20 "$OUT"/tp_group.log "$OUT"/backends_*.log; rm -f "$OUT"/*.log
    ;;
  multi-gpu)  # two GPUs (kind nvidia-h200-x2): greedy agreement and PD, then TP in a second call (multi-gpu-tp)
    step multi_gpu_greedy 120 python3 -m benchmarks.bench_multi_gpu --entries greedy --out-dir "$OUT"
    step multi_gpu_pd 450 python3 -m benchmarks.bench_multi_gpu --entries pd --out-dir "$OUT"
    ;;
  multi-gpu-tp)  # TP=2 (and 4 on four GPUs) against one GPU, end to end
    step multi_gpu_tp 570 python3 -m benchmarks.bench_multi_gpu --entries tp --out-dir "$OUT"
    ;;
  tp-check)  # a host of four GPUs, two groups at once: tp-all-reduce on GPUs 0-1, tests-multi-gpu on GPUs 2-3
    cores=$(( $(nproc) / 4 ))
    (CUDA_VISIBLE_DEVICES=2,3 taskset -c $((2 * cores))-$((4 * cores - 1)) bash "$0" tests-multi-gpu > "$OUT/tests_group.log" 2>&1) &
    CUDA_VISIBLE_DEVICES=0,1 taskset -c 0-$((2 * cores - 1)) bash "$0" tp-all-reduce
    wait; cat "$OUT/tests_group.log"; rm -f "$OUT/tests_group.log"
    ;;
  tests-multi-gpu)  # the tests of several GPUs alone (TP, PD, the symmetric all-reduce), on the GPUs visible, each
    # test named as it ends and a stack dump for one past 240 s: $OUT/gpu_tests_multi_gpu.txt
    make --no-print-directory install > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }; rm "$OUT/install.log"
    OFFLOAD_ENGINE_TEST_DEVICE=cuda timeout ${SHARD_LIMIT:-560} .venv/bin/python -m pytest -v -rs --durations=10 \
      -o faulthandler_timeout=240 tests/distributed tests/engine/disagg tests/test_two_devices.py \
      > "$OUT/gpu_tests_multi_gpu.txt" 2>&1
    grep -E "passed|failed|FAILED|Timeout" "$OUT/gpu_tests_multi_gpu.txt" | tail -n 15
    ;;
  tp-all-reduce)  # issue 61 on GPUs 0-1: one all-reduce in a graph, NCCL against the symmetric one-shot
    # (bench_all_reduce), then the TP decode step with each (OFFLOAD_ENGINE_ALL_REDUCE=nccl, then auto)
    step all_reduce 100 python3 -m benchmarks.bench_all_reduce --gpus 2 --out "$OUT/all_reduce.json"
    for choice in nccl auto; do
      mkdir -p "$OUT/steps_$choice"
      step tp_steps_$choice 200 env OFFLOAD_ENGINE_ALL_REDUCE=$choice python3 -m benchmarks.bench_multi_gpu \
        --entries tp_steps --tp-sizes 2 --profile --out-dir "$OUT/steps_$choice"
    done
    (cd "$OUT" && tar czf step_kernels.tgz steps_*/*_kernels.txt && rm -f steps_*/*_kernels.txt)  # $OUT's 8 files
    ;;
  tp-two-gpus)  # issue 61 on a host of two GPUs: the test that hung (a worker's error while rank 0 waits in a
    # collective) alone, with every process's stacks after 90 s; then one all-reduce in a graph, NCCL against the
    # one-shot, and the TP step with each (tp-all-reduce)
    make --no-print-directory install > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }; rm "$OUT/install.log"
    OFFLOAD_ENGINE_TEST_DEVICE=cuda OFFLOAD_ENGINE_STACKS_AFTER_S=90 timeout 130 .venv/bin/python -m pytest -v -s \
      -o faulthandler_timeout=90 "tests/distributed/test_tp_lifecycle.py::test_a_worker_error_surfaces_on_rank_0" \
      > "$OUT/worker_error_test.txt" 2>&1; echo "--- worker error test exit $?"; tail -n 40 "$OUT/worker_error_test.txt"
    bash "$0" tp-all-reduce
    ;;
  multi-gpu-steps)  # a TP decode step's wall against its graph's GPU time on every rank, then greedy agreement
    step multi_gpu_tp_steps 400 python3 -m benchmarks.bench_multi_gpu --entries tp_steps --out-dir "$OUT"
    step multi_gpu_greedy 150 python3 -m benchmarks.bench_multi_gpu --entries greedy --out-dir "$OUT"
    ;;
  gpu-bench)
    step gpu_attention 300 python3 benchmarks/bench_gpu_attention.py --out-dir "$OUT"
    ;;
  cpu-bench)
    step cpu_attention 300 python3 benchmarks/bench_cpu_attention.py --tag nvidia-h200-host \
      --out "$OUT/cpu_attention_nvidia-h200-host.json"
    ;;
  tiers)  # the 0.6B engine run of issue 2 on each placement, at a device pool that holds ~1/3 of the batch
    for placement in gpu auto cpu; do
      step throughput_$placement 150 python3 benchmarks/bench_throughput.py single --model qwen3-0.6b --num-seqs 64 \
        --prompt-len 512 --output-len 128 --kv-placement $placement --num-gpu-blocks 900 --cpu-kv-cache-gb 8 \
        --max-model-len 4096 --max-num-seqs 64 --out "$OUT/throughput_qwen3-0.6b_b64_900blocks_$placement.json"
    done
    ;;
esac
