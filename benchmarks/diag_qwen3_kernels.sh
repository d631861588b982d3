#!/bin/bash
# Which Inductor kernels of the tiny Qwen3 model are autotuned by timing under TORCHINDUCTOR_DETERMINISTIC=1 (the
# cause of verify check e differing between engines). Run on the device after `source .gpu/env.sh`; writes to $OUT.
export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_DETERMINISTIC=1 VLLM_CACHE_ROOT=/tmp/c1 TORCHINDUCTOR_COMPILE_THREADS=2
python3 -m hotwire_core.verify --arch qwen3 --runner v2 --dtype bfloat16 --kv-cache-gib 1 --save-plain /tmp/p.json > $OUT/verify.log 2>&1
echo "verify exit $?"
{
echo "best_config files:"; find /tmp/c1 -name '*.best_config' | while read f; do echo "$f"; cat "$f"; echo; done
echo "kernel sources with deterministic False:"; find /tmp/c1 -name '*.py' | xargs grep -l "'deterministic': False" | head
echo "persistent reductions with r0_ 128:"
for f in $(find /tmp/c1 -name '*.py' | xargs grep -l "r0_': 128"); do echo "== $f"; grep -n "@triton_heuristics\|size_hints=\|deterministic\|def triton" $f | cut -c1-400; done
} > $OUT/kernels.txt 2>&1
find /tmp/c1 -name '*.py' | xargs grep -l "r0_': 128" | head -6 | xargs -r tar -czf $OUT/k128.tar.gz
tail -5 $OUT/kernels.txt; wc -l $OUT/kernels.txt
