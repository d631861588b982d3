#!/bin/bash
# Here, before a GPU run that needs vLLM's fused-MoE kernels (Qwen3-MoE): the carried vLLM 0.25.1 bundle
# (../shared/gpu) leaves out `_moe_C`, so take it from vLLM's own wheel on PyPI into .gpu/moe.tar.xz (40 MB).
# On the device, unpack it in a call of its own between the bundle's two (the three parts together exceed one
# call's 64 MiB carry): bash .gpu/unpack.sh .gpu/moe.tar.xz, carrying .gpu/moe.tar.xz and .gpu/unpack.sh.
set -euo pipefail
version=${1:-0.25.1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download "vllm==$version" --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
  --python-version 3.11 -d "$work" -q
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('vllm/_moe_C_stable_libtorch.abi3.so', sys.argv[2])" \
  "$work"/vllm-"$version"-*.whl "$work/x"
mkdir -p .gpu
tar -cJf .gpu/moe.tar.xz -C "$work/x" vllm/_moe_C_stable_libtorch.abi3.so
ls -la .gpu/moe.tar.xz
