#!/bin/bash
# Issue #36's GPU checks in one go, on a machine with a CUDA GPU, in under 6 minutes:
#   1. the CUDA tests (every tests/**/test_*.py with a `cuda` mark, pytest -m cuda),
#   2. python -m bench.gpu: distckpt's default calls against PyTorch DCP and the limits,
#   3. python -m bench.gpu --memory-check: 100 async saves in a row, layers added and removed.
# Each step has its own timeout (T_TESTS + T_BENCH + T_MEM seconds, 330 in all by default) and is
# skipped with a message where what it needs is missing (CUDA, pytest, a dependency).
#
#   bash bench/gpu_check.sh [OUT_DIR]      (OUT_DIR: $1, else $OUT, else bench_out/gpu)
#
# It writes at most 7 files, all directly in OUT_DIR: gpu_check.log (everything printed), env.txt
# (machine and dependencies), cuda_tests.log, bench_gpu.json/.txt, memory_check.json/.txt.
# Wheels in .whl/ (for a machine without a package index: the project's dependencies the machine
# lacks) are installed into /tmp/site first. The lent machines' image (2026-11) has torch, numpy,
# tensorstore, ml-dtypes, psutil, click, rich, safetensors, pytest, hypothesis, pyyaml; it lacks
# fastcrc, obstore, zarr and zarr's numcodecs, donfig and google-crc32c. Exit status: 0 when no
# step failed (skipped steps do not count), else 1.
# GPU_CHECK_DEVICE=cpu (with small GPU_CHECK_SIZES_GIB, GPU_CHECK_HIDDEN=0, GPU_CHECK_SAVES and
# GPU_CHECK_MEMORY_HIDDEN) runs the two bench steps on host tensors, a smoke test and no
# measurement: how tests/benchmarks/test_bench_gpu.py checks this script without a GPU.
set -u
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${1:-${OUT:-bench_out/gpu}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
T_TESTS=${T_TESTS:-110}
T_BENCH=${T_BENCH:-160}
T_MEM=${T_MEM:-60}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
SIZES=${GPU_CHECK_SIZES_GIB:-2.5}
HIDDEN=${GPU_CHECK_HIDDEN:-2048}
SAVES=${GPU_CHECK_SAVES:-100}
MEM_HIDDEN=${GPU_CHECK_MEMORY_HIDDEN:-512}
exec > >(tee "$OUT/gpu_check.log") 2>&1
echo "== bench/gpu_check.sh: step timeouts: tests ${T_TESTS} s + bench ${T_BENCH} s + memory ${T_MEM} s" \
  "= $((T_TESTS + T_BENCH + T_MEM)) s"
failed=0
summary=()

export PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
  if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
    export PYTHONPATH=/tmp/site:$PWD
  else
    echo "== installing .whl/ failed: going on with the packages the machine has"
  fi
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4

{
  command -v nvidia-smi >/dev/null && nvidia-smi -L
  echo "cores: $(nproc)"
  free -g | head -2
  df -h /dev/shm /tmp | tail -2
} 2>&1 | tee "$OUT/env.txt"

# The project's own dependencies (pyproject.toml's [project] dependencies, nothing else), then what
# the steps need: exit 0 = distckpt imports (torch, numpy, fastcrc ...), CUDA and pytest there.
$PY - "$OUT/env.txt" <<'EOF'
import importlib, re, sys
from importlib.metadata import PackageNotFoundError, version
try:
    import tomllib
    deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
except ImportError:  # Python < 3.11: the list by hand from the same file
    text = open("pyproject.toml").read()
    deps = re.findall(r'"([^"]+)"', text.split("dependencies = [", 1)[1].split("]", 1)[0])
lines = [f"python {sys.version.split()[0]}"]
for dep in deps:
    name = re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0]
    try:
        importlib.import_module(name.replace("-", "_"))
        try:
            lines.append(f"dependency {name}: {version(name)}")
        except PackageNotFoundError:
            lines.append(f"dependency {name}: ok")
    except Exception as e:
        lines.append(f"dependency {name}: MISSING ({type(e).__name__}: {e})")
status = 0
try:
    import distckpt  # noqa: F401
    lines.append("import distckpt: ok")
except Exception as e:
    lines.append(f"import distckpt: FAILED ({type(e).__name__}: {e})")
    status |= 1
try:
    import torch
    cuda = torch.cuda.is_available()
    lines.append(f"torch {torch.__version__}, CUDA available: {cuda}" + (f", {torch.cuda.get_device_name()}" if cuda else ""))
    status |= 0 if cuda else 2
except Exception as e:
    lines.append(f"torch: FAILED ({e})")
    status |= 3
try:
    import pytest
    lines.append(f"pytest {pytest.__version__}")
except ImportError:
    lines.append("pytest: MISSING")
    status |= 4
print("\n".join(lines))
open(sys.argv[1], "a").write("\n".join(lines) + "\n")
sys.exit(status)
EOF
deps=$?
no_distckpt=$((deps & 1)); no_cuda=$(((deps & 2) >> 1)); no_pytest=$(((deps & 4) >> 2))

run_step() {  # run_step NAME SECONDS COMMAND...: one step, its outcome into the summary
  local name=$1 seconds=$2 rc t0=$SECONDS
  shift 2
  echo "== $name (timeout ${seconds} s)"
  timeout -k 5 "$seconds" "$@"
  rc=$?
  if [ $rc -eq 0 ]; then
    summary+=("$name: ok ($((SECONDS - t0)) s)")
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    summary+=("$name: TIMED OUT after ${seconds} s")
    failed=1
  else
    summary+=("$name: FAILED (exit $rc, $((SECONDS - t0)) s)")
    failed=1
  fi
}

skip() {
  echo "== $1: skipped ($2)"
  summary+=("$1: skipped ($2)")
}

D=/dev/shm/distckpt-gpu
avail=$(df --output=avail -k /dev/shm 2>/dev/null | tail -1)
[ "${avail:-0}" -lt 14000000 ] && D=/tmp/distckpt-gpu
echo "== checkpoints under $D"

if [ $no_cuda -eq 1 ]; then
  skip "CUDA tests" "no CUDA device"
elif [ $no_pytest -eq 1 ]; then
  skip "CUDA tests" "pytest is not installed"
elif [ $no_distckpt -eq 1 ]; then
  skip "CUDA tests" "distckpt does not import: a dependency is missing (env.txt)"
else
  mapfile -t files < <(grep -rlE --include='test_*.py' 'mark\.cuda|pytest\.mark\.cuda' tests | sort)
  run_step "CUDA tests" "$T_TESTS" bash -c 'set -o pipefail; "$0" -m pytest -q -p no:cacheprovider -m cuda -rs \
    --continue-on-collection-errors "${@:2}" 2>&1 | tee "$1"' "$PY" "$OUT/cuda_tests.log" "${files[@]}"
fi

if [ $no_cuda -eq 1 ] && [ "$DEVICE" = cuda ]; then
  skip "bench.gpu" "no CUDA device"
  skip "memory check" "no CUDA device"
elif [ $no_distckpt -eq 1 ]; then
  skip "bench.gpu" "distckpt does not import: a dependency is missing (env.txt)"
  skip "memory check" "distckpt does not import: a dependency is missing (env.txt)"
else
  run_step "bench.gpu" "$T_BENCH" "$PY" -m bench.gpu --device "$DEVICE" --dir "$D" --sizes-gib "$SIZES" \
    --hidden "$HIDDEN" --reps 3 --max-seconds $((T_BENCH - 50)) --out "$OUT"
  run_step "memory check" "$T_MEM" "$PY" -m bench.gpu --device "$DEVICE" --memory-check --saves "$SAVES" \
    --memory-hidden "$MEM_HIDDEN" --dir "$D" --max-seconds $((T_MEM - 15)) --out "$OUT"
fi

echo "== summary ($SECONDS s in all)"
printf '  %s\n' "${summary[@]}"
exit $failed
