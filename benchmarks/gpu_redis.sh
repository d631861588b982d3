#!/bin/bash
# A redis-server and redis-py for the GPU device machine, which has neither (and no network):
#   bash benchmarks/gpu_redis.sh        # here: copies this machine's redis-server (Debian's package), the shared
#                                       # libraries it needs beyond glibc/libstdc++, and the installed redis-py
#                                       # into .gpu/redis/ (git-ignored, a few MB)
#   source .gpu/redis/env.sh            # there: puts them on PATH, LD_LIBRARY_PATH and PYTHONPATH
# Carry .gpu/redis with the device call. benchmarks/gpu_checks.sh's `fleet` part needs it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=.gpu/redis
exe=$(command -v redis-server) || { echo "gpu_redis.sh: redis-server is not installed (apt-get install redis-server)" >&2; exit 1; }
py=${PYTHON:-.venv/bin/python}
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/py"
cp "$(readlink -f "$exe")" "$out/bin/redis-server"
# Every library the binary loads except the C and C++ runtimes, which the device has (and must match its loader).
ldd "$exe" | awk '$3 ~ /^\// {print $3}' | grep -vE '/(libc|libm|libstdc\+\+|libgcc_s)\.so' | while read -r lib; do
    cp "$(readlink -f "$lib")" "$out/lib/$(basename "$lib")"
done
cp -r "$("$py" -c 'import os, redis; print(os.path.dirname(redis.__file__))')" "$out/py/redis"
find "$out/py" -name __pycache__ -prune -exec rm -rf {} +
cat > "$out/env.sh" <<'EOF'
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PATH="$here/bin:$PATH" LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$here/py${PYTHONPATH:+:$PYTHONPATH}"
redis-server --version
EOF
"$out/bin/redis-server" --version
du -sh "$out"
