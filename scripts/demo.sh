#!/usr/bin/env bash
# The main job on a built-in default: bash scripts/demo.sh [demo args...]
#
# Installs what is missing into .venv (scripts/setup-cpu.sh), then runs `python -m hotwire_api.demo`: a tiny model
# built offline, vLLM with hotwire, a vector registered over HTTP, plain vs steered output and the slot table.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup-cpu.sh
exec .venv/bin/python -m hotwire_api.demo "$@"
