#!/bin/bash
# Correctness on the GPU: bash benchmarks/gpu_checks.sh [engine] [identity] [ops]   (default: all three)
#   engine:   tests/integration/test_engine.py in bf16 with CUDA graphs (FULL_AND_PIECEWISE: FULL for decode
#             steps, PIECEWISE for prefill) on the V2 and the V1 runner, with a plugin-free vLLM as reference
#   identity: tests/integration/test_bit_identity.py (plain requests bit-identical to plugin-free vLLM), V2 and V1
#   ops:      tests/unit/test_ops.py (Triton op vs reference, CUDA-graph replay)
# Run on the device after `source .gpu/env.sh`; logs go to $OUT. All three take more than one 10-minute call.
set -o pipefail
out=${OUT:-/tmp/hotwire-out}
mkdir -p "$out"
parts=${*:-engine identity ops}
{
  date -u +"date: %Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  echo "command: bash benchmarks/gpu_checks.sh $parts"
} > "$out/gpu-env.txt"
cat "$out/gpu-env.txt"
status=0
run() { # run NAME TIMEOUT PYTEST-ARGS...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m pytest -q -rA -p no:cacheprovider "$@" > "$out/$name.log" 2>&1 || status=1
  echo "$name: $(tail -n 1 "$out/$name.log")"
}
for part in $parts; do
  case $part in
    engine | identity)
      file=tests/integration/$([ "$part" = engine ] && echo test_engine.py || echo test_bit_identity.py)
      VLLM_USE_V2_MODEL_RUNNER=1 run "$part-runner-v2" 290 "$file"
      VLLM_USE_V2_MODEL_RUNNER=0 run "$part-runner-v1" 290 "$file"
      ;;
    ops) run ops 150 tests/unit/test_ops.py ;;
    *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
done
exit $status
