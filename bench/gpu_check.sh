#!/bin/bash
# The GPU checks of issue #17 in one go, on a machine with one or more CUDA GPUs:
# the CUDA tests (pytest -m cuda) and bench/gpu.py (async save blocking vs the bare
# device-to-host copy, load to GPU vs the host-to-device copy and the raw read).
#   bash bench/gpu_check.sh [OUT_DIR]     (from the repository root)
# Dependencies: those of scripts/setup.sh with a CUDA build of torch. On a machine without a
# package index, wheels in .whl/ are installed to /tmp/site first (for the machine's python3).
set -u
OUT=${1:-${OUT:-bench_out/gpu}}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
nvidia-smi -L; nproc; free -g | head -2; df -h /dev/shm /tmp | tail -2
python3 -c "import torch, numpy, zarr, fastcrc, obstore; print(torch.__version__, torch.cuda.is_available(), numpy.__version__, zarr.__version__)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda -rs tests/strategies/test_devices.py tests/strategies/test_async_utils.py \
  tests/strategies/test_fully_parallel.py 2>&1 | tee "$OUT/cuda_tests.log" | tail -25
D=/dev/shm/distckpt-gpu; avail=$(df --output=avail -k /dev/shm | tail -1); [ "$avail" -lt 14000000 ] && D=/tmp/distckpt-gpu
echo "bench dir $D"
timeout 200 python3 -m bench.gpu --dir $D --sizes-gib 1,4 --reps 3 --threads 2 --out "$OUT/t2" 2>&1 | tail -45
timeout 90 python3 -m bench.gpu --dir $D --sizes-gib 4 --reps 2 --threads 8 --out "$OUT/t8" 2>&1 | tail -22
