#!/usr/bin/env bash
# Lint, then run the test suite, in the project's venv (set up first if needed): bash scripts/test.sh [pytest args]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
venv=${DISTCKPT_VENV:-$root/.venv}
cd "$root"
# The lint and the format check first (pyproject.toml's [tool.ruff]): a finding fails the run before
# the tests start.
"$venv/bin/ruff" check --quiet .
"$venv/bin/ruff" format --check --quiet .
# With no test path among the arguments, pytest runs its configured testpaths (tests/).
exec "$venv/bin/python" -m pytest "$@"
