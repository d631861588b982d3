#!/bin/bash
# Dump every vLLM process's Python stacks when a server log reports a stuck shared-memory broadcast.
start=$(date +%s)
while sleep 5; do
  f=$(grep -l "No available shared memory broadcast block" $(find /tmp/hang/run -name "server-*.log" 2>/dev/null) 2>/dev/null | head -1)
  if [ -n "$f" ]; then
    echo "hang seen in $f at $(date)" > /tmp/hang/dump.txt
    for pid in $(pgrep -f "VLLM::|vllm_cli serve|multiprocessing.spawn|multiprocessing.resource" ); do
      echo "=== $pid $(tr '\0' ' ' < /proc/$pid/cmdline | cut -c1-150)" >> /tmp/hang/dump.txt
      timeout 20 /work/main/.venv/bin/py-spy dump --pid $pid >> /tmp/hang/dump.txt 2>&1
    done
    exit 0
  fi
  [ $(( $(date +%s) - start )) -gt 1500 ] && exit 1
done
