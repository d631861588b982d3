#!/bin/bash
# On the device (after `source .gpu/env.sh`): the load targets of hotwire, one after the other on one GPU.
#   bash benchmarks/gpu_load.sh [soak] [throughput] [prefill] [tenants] [throughput_4b]   (default: the first three)
# soak: python3 -m benchmarks.soak, SOAK_CLIENTS (256) clients for SOAK_DURATION (600) s, 16 slots, churn.
# tenants: the soak with 4 tenants (#40), SOAK_CLIENTS clients, 64 slots, a tenant's share 16 rows; once without
#   a flood for TENANT_DURATION (240) s and once with a tenant flooding distinct vectors for TENANT_FLOOD_DURATION
#   (TENANT_DURATION) s (compare the others' p99; #40's soak is the flood half at 600 s); TENANT_PROFILE=S py-spies
#   the API server and the engine core for S s in the middle of each half (py-spy on PATH); TENANT_FLOOD_WINDOWS=S
#   runs the flood half alone, flooding in every other window of S s, the first quiet (the other tenants with and
#   without the flood side by side on one server: its report's "flood_windows"). Longer than one device
#   call: start it detached (setsid nohup) and follow its log over several calls. Both
#   halves build the model in one folder, so the second server can reuse the first one's compiled graphs (each start
#   took 106-113 s on the H200 with a folder of its own).
# throughput: benchmarks/bench_throughput.py, plugin-free vLLM vs hotwire plain vs hotwire 75 % steered,
#   THROUGHPUT_CLIENTS (128) streaming clients, THROUGHPUT_ROUNDS (6: a 97% interval of each median ratio) rotated
#   rounds of THROUGHPUT_SECONDS (10) s; THROUGHPUT_PROFILE=1
#   adds --profile (py-spy on PATH: its binary from the development venv, carried in .gpu/py/bin); THROUGHPUT_SALTED=1
#   adds --salted (plugin-free vLLM with 75 % of the requests salted for the prefix cache: the floor of steered / plain);
#   THROUGHPUT_MONITORS=N adds --monitors N (a third server, hotwire with N monitors on all its plain traffic);
#   THROUGHPUT_QUEUE_PROBE=1 puts benchmarks/queue_probe/ first on every server's PYTHONPATH: each engine core logs
#   its scheduler's add_request and schedule calls and its handling of every client message (added requests with
#   hotwire's admission, utility calls), and analyze.py tells per steered and plain request how long it waited in the
#   scheduler's queue, how many schedule calls passed it by and what the engine core handled in between (#39, #40).
# throughput_4b: the throughput step with the GPU the limit: a Qwen3-4B shape (bf16, dummy weights), 128-token
#   answers, 4 monitors (#39: monitors on all traffic, steering and plain traffic against plugin-free vLLM).
# prefill: benchmarks/bench_prefill.py, Qwen3-4B shape, 8192-token prompts, PREFILL_ROUNDS (16).
# Outputs go to $OUT (JSON and text per step); each step's exit status is printed.
set -o pipefail
out=${OUT:-/tmp/hotwire-gpu-load}
mkdir -p "$out"
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(soak throughput prefill)
# The carried vLLM bundle has no gguf, which hotwire_api imports at start: copy it from the development venv
# (cp -r .venv/lib/python3.11/site-packages/gguf .gpu/py/site/) and carry .gpu/py.
[[ -d .gpu/py/site ]] && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/.gpu/py/site
python3 -c "import gguf" 2>/dev/null || { echo "no gguf here: every server would exit at start; see the comment above this line" >&2; exit 1; }
python3 -c "import hotwire_api, vllm, torch; print('hotwire_api', hotwire_api.__file__, '| vllm', vllm.__version__, '| torch', torch.__version__)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
git_tree=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "tree: $git_tree (uncommitted changes, if any, are part of the run: git status below)"
git status --short 2>/dev/null | head -20
for step in "${steps[@]}"; do
  echo "=== $step: start $(date -u +%FT%TZ)"
  case $step in
    soak)
      python3 -m benchmarks.soak --clients "${SOAK_CLIENTS:-256}" --duration "${SOAK_DURATION:-600}" --slots 16 \
        --server-arg=--max-num-seqs=256 --workdir /tmp/soak-gpu --out "$out/soak_gpu.json" 2>&1 \
        | tee "$out/soak_gpu.txt" | tail -60 ;;
    throughput)
      probe=()
      if [[ -n ${THROUGHPUT_QUEUE_PROBE:-} ]]; then
        mkdir -p "$out/queue_probe"
        probe=(env HOTWIRE_QUEUE_PROBE_OUT="$out/queue_probe" PYTHONPATH="$PWD/benchmarks/queue_probe:$PYTHONPATH")
      fi
      "${probe[@]}" python3 -m benchmarks.bench_throughput --clients "${THROUGHPUT_CLIENTS:-128}" --rounds "${THROUGHPUT_ROUNDS:-6}" \
        ${THROUGHPUT_PROFILE:+--profile} ${THROUGHPUT_SALTED:+--salted} \
        ${THROUGHPUT_MONITORS:+--monitors "$THROUGHPUT_MONITORS"} \
        --seconds "${THROUGHPUT_SECONDS:-10}" --warmup 5 --server-arg=--max-num-seqs=256 --server-arg=--kv-cache-memory-bytes=8589934592 \
        --workdir /tmp/throughput-gpu --out "$out/throughput_gpu.json" 2>&1 | tee "$out/throughput_gpu.txt" | tail -30
      rc=${PIPESTATUS[0]}
      # the probe's logs are whole even where a request failed (bench_throughput then exits 1)
      [[ -n ${THROUGHPUT_QUEUE_PROBE:-} ]] && python3 -m benchmarks.queue_probe.analyze "$out/queue_probe" \
        --out "$out/queue_probe.json" | tail -40
      (exit "$rc") ;;  # the step's status is the benchmark's
    throughput_4b)
      python3 -m benchmarks.bench_throughput --shape qwen3-4b --max-tokens 128 --monitors 4 \
        --clients "${THROUGHPUT_CLIENTS:-128}" --rounds "${THROUGHPUT_ROUNDS:-3}" --seconds "${THROUGHPUT_SECONDS:-10}" \
        --warmup 5 --server-arg=--max-num-seqs=256 --server-arg=--kv-cache-memory-bytes=8589934592 \
        --server-arg=--gpu-memory-utilization=0.3 --workdir /tmp/throughput-4b-gpu --out "$out/throughput_4b_gpu.json" \
        2>&1 | tee "$out/throughput_4b_gpu.txt" | tail -30 ;;
    tenants)
      halves=("" --flood)
      [[ -n ${TENANT_FLOOD_WINDOWS:-} ]] && halves=(--flood)
      for flood in "${halves[@]}"; do
        name=tenants${flood:+_flood}
        duration=${TENANT_DURATION:-240}
        [[ -n $flood ]] && duration=${TENANT_FLOOD_DURATION:-$duration}
        python3 -m benchmarks.soak --tenants 4 $flood --tenant-rows 16 --slots 64 --clients "${SOAK_CLIENTS:-256}" \
          --ids 12 --churned 4 --pool 2 --duration "$duration" --server-arg=--max-num-seqs=256 \
          ${TENANT_PROFILE:+--profile "$TENANT_PROFILE"} ${TENANT_FLOOD_WINDOWS:+--flood-windows "$TENANT_FLOOD_WINDOWS"} \
          --workdir /tmp/tenants-gpu --out "$out/${name}_gpu.json" 2>&1 | tee "$out/${name}_gpu.txt" | tail -12
      done ;;
    prefill)
      python3 benchmarks/bench_prefill.py --shape qwen3-4b --prompt-len 8192 --rounds "${PREFILL_ROUNDS:-16}" \
        --out "$out/bench_prefill_4b_8k.json" 2>&1 | tee "$out/bench_prefill.txt" | tail -6 ;;
    *) echo "unknown step $step (soak, throughput, prefill, tenants, throughput_4b)"; false ;;
  esac
  echo "=== $step: exit ${PIPESTATUS[0]} $(date -u +%FT%TZ)"
done
