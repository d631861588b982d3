#!/bin/bash
# Correctness on the GPU: the engine integration tests (bf16, CUDA graphs FULL_AND_PIECEWISE: FULL for decode
# steps, PIECEWISE for prefill) on both model runners, plus the op tests. Run on the device after
# `source .gpu/env.sh`; logs go to $OUT.
set -o pipefail
out=${OUT:-/tmp/hotwire-out}
mkdir -p "$out"
{
  date -u +"date: %Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  echo "command: bash benchmarks/gpu_checks.sh"
} > "$out/gpu-env.txt"
cat "$out/gpu-env.txt"
status=0
for runner in 2 1; do
  v2=$([ "$runner" = 2 ] && echo 1 || echo 0)
  VLLM_USE_V2_MODEL_RUNNER=$v2 timeout 270 python3 -m pytest tests/integration/test_engine.py -q -rA -p no:cacheprovider \
    > "$out/engine-runner-v$runner.log" 2>&1 || status=1
  echo "runner V$runner: $(tail -n 1 "$out/engine-runner-v$runner.log")"
done
timeout 120 python3 -m pytest tests/unit/test_ops.py -q -p no:cacheprovider > "$out/ops.log" 2>&1 || status=1
echo "ops: $(tail -n 1 "$out/ops.log")"
exit $status
