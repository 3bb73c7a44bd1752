#!/usr/bin/env bash
# Idempotent set-up: a virtual environment with distckpt installed editable, plus its test extras
# (pytest & co., ruff, and megatron-core for the interoperability tests).
#
#   bash scripts/setup.sh
#
# Needs only python3 with pip. Environment:
#   DISTCKPT_VENV         where the venv lives (default: <repo>/.venv)
#   DISTCKPT_CONSTRAINTS  pip constraints file (default: <repo>/constraints.txt, which pins the CPU
#                         torch); a GPU user points this at a file of their own
#   PYTHON                interpreter that creates the venv (default: python3)
#
# torch is installed first, alone and under the constraints, so that resolving the other
# requirements never pulls a CUDA build. A stamp in the venv records the sha256 of pyproject.toml
# and the constraints file; when it matches and distckpt + torch import, nothing is done.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${DISTCKPT_VENV:-$root/.venv}
constraints=${DISTCKPT_CONSTRAINTS:-$root/constraints.txt}
python=${PYTHON:-python3}
stamp=$venv/.distckpt-setup.sha256

[ -f "$constraints" ] || { echo "setup.sh: constraints file not found: $constraints" >&2; exit 1; }
want=$(cat "$root/pyproject.toml" "$constraints" \
    | "$python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')

# The import check runs outside the repo so that it finds the installed (editable) distckpt, and it
# must be this checkout's distckpt: a venv shared between checkouts would otherwise test the wrong code.
installed() {
    (cd / && "$venv/bin/python" - "$root" <<'PY'
import os, sys
import distckpt, torch  # noqa: F401
here = os.path.realpath(os.path.dirname(distckpt.__file__))
sys.exit(0 if here == os.path.join(os.path.realpath(sys.argv[1]), "distckpt") else 1)
PY
    ) >/dev/null 2>&1
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && installed; then
    exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "setup.sh: creating $venv" >&2
    "$python" -m venv "$venv"
fi
rm -f "$stamp"

# pip -q still warns once per package about each configured local index folder that has no entry
# for it; those lines are noise, every other line (and pip's exit status) comes through.
pip_install() {
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$venv/bin/python" -m pip install -q -c "$constraints" "$@" 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
}

echo "setup.sh: installing torch (constraints: $constraints)" >&2
pip_install torch
echo "setup.sh: installing distckpt[test,dev,megatron] (editable)" >&2
# megatron-core is a test-only extra: the interop tests run against its real classes.
pip_install -e "$root[test,dev,megatron]"

if ! installed; then
    echo "setup.sh: after installing, 'import distckpt, torch' still fails in $venv:" >&2
    (cd / && "$venv/bin/python" -c "import distckpt, torch; print(distckpt.__file__)") >&2 || true
    exit 1
fi
echo "$want" > "$stamp"
echo "setup.sh: ready ($venv)" >&2
