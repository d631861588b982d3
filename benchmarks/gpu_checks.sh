#!/bin/bash
# Correctness on the GPU, every job at once: bash benchmarks/gpu_checks.sh [PART...]   (default: all parts but fleet)
#   engine:   tests/integration/test_engine.py in bf16 with CUDA graphs (FULL_AND_PIECEWISE: FULL for decode
#             steps, PIECEWISE for prefill), plugin-free vLLM as reference; V2 and V1 runner
#   identity: tests/integration/test_bit_identity.py (plain requests bit-identical to plugin-free vLLM); V2 and V1
#   ops:      tests/unit/test_ops.py (Triton op vs reference, CUDA-graph replay)
#   capture:  tests/unit/test_capture.py (the capture kernel compiled, under graph replay) and
#             tests/integration/test_extraction.py (HOTWIRE_CAPTURE=1: extracted vectors vs transformers with hooks,
#             the plain batchmate of an extraction vs plugin-free vLLM); V2 and V1 runner
#   readout:  tests/unit/test_readout.py, test_gates.py (the readout and gated kernels compiled) and
#             tests/integration/test_readout.py, test_readout_http.py (HOTWIRE_READOUT=1: readouts and gated steering
#             vs transformers with hooks, offline and through `vllm serve`, the plain batchmate of readouts vs
#             plugin-free vLLM); V2 and V1 runner
#   async:    tests/integration/test_async_engine.py (AsyncLLM: streaming-input sessions, pause_generation, a
#             request waiting for a bank row) and test_unsteerable_model.py (GPT-2: starts, refuses steering); V2, V1
#   server:   tests/integration/test_server.py: real `vllm serve` with graphs on (float32 tiny model, fixed 1 GiB KV
#             cache); V2 runner
#   hardening: tests/integration/test_hardening.py: every route and encoding admitted alike, bounded memory, large
#             uploads off the event loop, the fuzz suite; real `vllm serve` with graphs on; V2 runner
#   matrix:   python -m hotwire_core.verify --vanilla on tiny Llama, Qwen2, Qwen3, Mistral, Gemma, Qwen3-MoE and
#             Gemma 3 (sliding window) models with random weights, bf16, graphs on; V2 and V1 runner. MATRIX_ARCHS picks architectures (e.g. "qwen3");
#             MATRIX_REPEAT=N runs each N times, each with its own compile cache (jobs named ...-r1, -r2, ...)
#   families: tests/integration/test_model_families.py and test_family_bit_identity.py (Qwen3-MoE, Gemma 3, Command R,
#             Granite 4: steering vs transformers with hooks, plain requests vs plugin-free vLLM; on a GPU with graphs
#             on); V2 and V1 runner; FAMILIES_K selects tests (pytest -k; default "not qwen3_next"). Qwen3-MoE
#             needs vLLM's MoE kernels unpacked beside the bundle (benchmarks/gpu_moe_kernels.sh)
#   fleet:    tests/integration/test_fleet.py: two `vllm serve` replicas on one GPU and one redis-server, with
#             graphs on; propagation and registration latency over FLEET_N replaces (default 200) written to
#             fleet_propagation.json. Needs `bash benchmarks/gpu_redis.sh` here and `source .gpu/redis/env.sh` there
#   tp2:      verify --vanilla with --tensor-parallel-size 2 (needs 2 GPUs); V2 and V1 runner
#   quantized: tests/integration/test_quantized.py, one job per format (GPTQ 4-bit, FP8 weights, FP8 KV cache):
#             steering exact within the format's rounding, plain requests bit-identical; V2 runner
#   configs:  verify --vanilla under serving configurations: --quantization fp8, --kv-cache-dtype fp8, a 64-token
#             step budget (prompts in chunks), Qwen3-MoE and Gemma 3 (V2 runner); ngram speculation (V1 runner: on
#             V2 vLLM 0.25.1 stopped at its configuration); with LORA_ADAPTER=PATH (a peft folder for the tiny
#             Qwen3, e.g. from tests/lora_adapter.py) every request with that adapter, V2 runner
#   speculation: tests/integration/test_speculative.py, test_speculative_draft.py, test_speculative_eagle.py,
#             test_speculative_mtp.py (n-gram, a draft model, an EAGLE head, a MiMo MTP layer: steered requests vs
#             the same without speculation, plain vs plugin-free vLLM with the same speculation, readouts vs
#             transformers); V1 runner (V2 vLLM 0.25.1 stops at its configuration with speculation)
#   features: tests/integration/test_request_features.py and test_vector_formats.py against `vllm serve` with
#             graphs on; V2 runner
# One-GPU jobs are spread round-robin over the visible GPUs (or those in CHECK_GPUS, e.g. "1"); each has its own compile cache and a fixed KV cache, so
# several share a GPU. Logs go to $LOG_DIR (default $OUT, else /tmp/hotwire-gpu-checks), one per job, plus
# summary.txt; JOB_TIMEOUT (default 540 s) bounds each job. Run on the device after `source .gpu/env.sh`.
set -o pipefail
log_dir=${LOG_DIR:-${OUT:-/tmp/hotwire-gpu-checks}}
limit=${JOB_TIMEOUT:-540}
mkdir -p "$log_dir"
parts=${*:-engine identity ops async server matrix tp2}
n_gpus=$(nvidia-smi -L | wc -l)
read -r -a gpus_list <<< "${CHECK_GPUS:-$(seq -s ' ' 0 $((n_gpus - 1)))}"  # GPUs for the one-GPU jobs
{
  date -u +"date: %Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; from vllm.version import __version__ as v; print('vllm', v, 'torch', torch.__version__)"
  echo "command: bash benchmarks/gpu_checks.sh $parts"
} > "$log_dir/gpu-env.txt"
cat "$log_dir/gpu-env.txt"

jobs_started=0
names=()
launch() { # launch NAME GPUS RUNNER COMMAND...: run in the background with its own GPU(s) and compile cache
  local name=$1 gpus=$2 runner=$3
  shift 3
  [ "$gpus" = next ] && gpus=${gpus_list[$((jobs_started % ${#gpus_list[@]}))]}
  jobs_started=$((jobs_started + 1))
  names+=("$name")
  (
    export CUDA_VISIBLE_DEVICES=$gpus VLLM_USE_V2_MODEL_RUNNER=$([ "$runner" = v1 ] && echo 0 || echo 1)
    export VLLM_CACHE_ROOT=/tmp/hotwire-vllm-cache-$name TORCHINDUCTOR_COMPILE_THREADS=2 PYTHONUNBUFFERED=1
    # Engines compared bit for bit compile separately, on a GPU busy with the other jobs: no kernel choice may
    # depend on timing. The tests and verify compile them with hotwire_core.verify.UNTIMED_INDUCTOR.
    start=$(date +%s)
    timeout "$limit" "$@" > "$log_dir/$name.log" 2>&1
    echo "exit $? after $(($(date +%s) - start)) s" > "$log_dir/$name.status"
  ) &
}
pytest_cmd=(python3 -m pytest -q -rA -p no:cacheprovider)
verify_cmd=(python3 -m hotwire_core.verify --vanilla --dtype bfloat16 --kv-cache-gib 1)
for part in $parts; do
  case $part in
    engine | identity)
      file=tests/integration/$([ "$part" = engine ] && echo test_engine.py || echo test_bit_identity.py)
      for runner in v2 v1; do launch "$part-$runner" next $runner "${pytest_cmd[@]}" "$file"; done
      ;;
    ops) launch ops next v2 "${pytest_cmd[@]}" tests/unit/test_ops.py ;;
    families)
      for runner in v2 v1; do
        # Qwen3-Next left out: vLLM's gated delta net needs FlashInfer on a GPU, which the bundle lacks.
        launch "families-$runner" next $runner "${pytest_cmd[@]}" -s -k "${FAMILIES_K:-not qwen3_next}" \
          tests/integration/test_model_families.py tests/integration/test_family_bit_identity.py
      done
      ;;
    capture)
      for runner in v2 v1; do
        launch "capture-$runner" next $runner "${pytest_cmd[@]}" -s tests/unit/test_capture.py \
          tests/integration/test_extraction.py
      done
      ;;
    readout)  # the unit files apart: tests/unit and tests/integration both hold a test_readout.py
      launch readout-kernels next v2 "${pytest_cmd[@]}" -s tests/unit/test_readout.py tests/unit/test_gates.py
      for runner in v2 v1; do
        launch "readout-$runner" next $runner "${pytest_cmd[@]}" -s tests/integration/test_readout.py \
          tests/integration/test_readout_http.py
      done
      ;;
    async)
      for runner in v2 v1; do
        launch "async-$runner" next $runner "${pytest_cmd[@]}" tests/integration/test_async_engine.py \
          tests/integration/test_unsteerable_model.py
      done
      ;;
    server) launch server next v2 "${pytest_cmd[@]}" tests/integration/test_server.py ;;
    hardening) launch hardening next v2 "${pytest_cmd[@]}" -s tests/integration/test_hardening.py ;;
    fleet)
      launch fleet next v2 env HOTWIRE_FLEET_LATENCY_N="${FLEET_N:-200}" \
        HOTWIRE_FLEET_RESULTS="$log_dir/fleet_propagation.json" "${pytest_cmd[@]}" -s tests/integration/test_fleet.py
      ;;
    matrix)
      repeat=${MATRIX_REPEAT:-1}
      for arch in ${MATRIX_ARCHS:-llama qwen2 qwen3 mistral gemma qwen3_moe gemma3}; do
        for runner in v2 v1; do
          for rep in $(seq 1 "$repeat"); do
            launch "matrix-$arch-$runner$([ "$repeat" -gt 1 ] && echo "-r$rep")" next $runner \
              "${verify_cmd[@]}" --arch $arch --runner $runner
          done
        done
      done
      ;;
    quantized)
      for format in gptq-4bit fp8-weights fp8-kv-cache; do
        launch "quantized-$format" next v2 "${pytest_cmd[@]}" -s -k "$format" tests/integration/test_quantized.py
      done
      ;;
    configs)
      launch verify-fp8 next v2 "${verify_cmd[@]}" --quantization fp8
      launch verify-kv-fp8 next v2 "${verify_cmd[@]}" --kv-cache-dtype fp8
      launch verify-chunked next v2 "${verify_cmd[@]}" --max-num-batched-tokens 64
      launch verify-qwen3-moe next v2 "${verify_cmd[@]}" --arch qwen3_moe
      launch verify-gemma3 next v2 "${verify_cmd[@]}" --arch gemma3
      launch verify-ngram next v1 "${verify_cmd[@]}" --runner v1 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
      if [ -n "${LORA_ADAPTER:-}" ]; then
        launch verify-lora next v2 "${verify_cmd[@]}" --lora "$LORA_ADAPTER"
      fi
      ;;
    speculation)
      for method in "" _draft _eagle _mtp; do
        launch "speculation${method:-_ngram}" next v1 "${pytest_cmd[@]}" -s "tests/integration/test_speculative$method.py"
      done
      ;;
    features)
      launch features next v2 "${pytest_cmd[@]}" tests/integration/test_request_features.py
      launch vector-formats next v2 "${pytest_cmd[@]}" tests/integration/test_vector_formats.py
      ;;
    tp2)
      if [ "$n_gpus" -lt 2 ]; then echo "tp2: needs 2 GPUs, $n_gpus visible" > "$log_dir/tp2.status"; continue; fi
      for runner in v2 v1; do
        launch "tp2-$runner" 0,1 $runner "${verify_cmd[@]}" --tensor-parallel-size 2 --runner $runner
      done
      ;;
    *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
done
wait
status=0
for name in "${names[@]}"; do
  last=$(grep -E "passed|failed|error|PASS|FAIL" "$log_dir/$name.log" | tail -n 1)
  line="$name: $(cat "$log_dir/$name.status") | $last"
  echo "$line" | tee -a "$log_dir/summary.txt"
  grep -q "^exit 0 " "$log_dir/$name.status" || status=1
done
exit $status
