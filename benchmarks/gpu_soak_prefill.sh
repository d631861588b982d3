#!/bin/bash
# On the device (after `source .gpu/env.sh`): the soak at production concurrency, then the long-prompt prefill
# cost, one after the other on one GPU. Outputs go to $OUT (soak JSON and table, prefill JSON and log).
#   SOAK_CLIENTS (256), SOAK_DURATION (240 s), PREFILL_ROUNDS (16)
set -o pipefail
out=${OUT:-/tmp/hotwire-gpu-soak}
mkdir -p "$out"
python3 -c "import hotwire_api, vllm, torch; print('hotwire_api', hotwire_api.__file__, '| vllm', vllm.__version__, '| torch', torch.__version__)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 benchmarks/soak.py --clients "${SOAK_CLIENTS:-256}" --duration "${SOAK_DURATION:-240}" --slots 16 \
  --server-arg=--max-num-seqs=256 --workdir /tmp/soak-gpu --out "$out/soak_gpu.json" 2>&1 | tee "$out/soak_gpu.txt" | tail -60
echo "soak exit ${PIPESTATUS[0]}"
python3 benchmarks/bench_prefill.py --shape qwen3-4b --prompt-len 8192 --rounds "${PREFILL_ROUNDS:-16}" \
  --out "$out/bench_prefill_4b_8k.json" 2>&1 | tee "$out/bench_prefill.txt" | tail -4
echo "prefill exit ${PIPESTATUS[0]}"
