#!/usr/bin/env bash
# Run `distckpt demo` in the project's venv (set up first if needed): bash scripts/demo.sh [--world-size N] [--dir D] [--keep]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
venv=${DISTCKPT_VENV:-$root/.venv}
exec "$venv/bin/distckpt" demo "$@"
