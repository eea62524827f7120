#!/usr/bin/env bash
# On a CUDA machine (no Ray, Redis or models needed): one-call kernel timings of every
# verifier, then its exact one-iteration and loop-level laws with the verifiers on the GPU.
#   bash scripts/gpu_checks.sh [OUT_DIR]        (PYTHON=... to pick the interpreter)
# Writes gpu.txt, verify.md, verify.json and laws.txt under OUT_DIR
# (default .cache/gpu). BATCH / VOCAB pick the grid (default: issue 14's goal grid).
set -uo pipefail
status=0
out=${1:-.cache/gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
# The code as the installed package blockspec (pyproject.toml maps the folders), without
# installing it: a folder whose blockspec/ links to this checkout's folders.
view=$(mktemp -d) && mkdir "$view/blockspec"
for d in service workers verification protos loadtest models; do ln -s "$PWD/$d" "$view/blockspec/$d"; done
export OMP_NUM_THREADS=2 PYTHONUNBUFFERED=1 PYTHONPATH=$view:.${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
"$py" -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"

# Kernel timings first (the shorter job): median of 21 calls after a warm-up, synchronised;
# then one profiled call per cell (kernels launched, GPU busy time, host waits); then the
# median of 21 calls replayed from CUDA graphs and whether their tokens equal the eager call's.
timeout "${BENCH_TIMEOUT:-300}" "$py" -m blockspec.loadtest.bench verify --device cuda \
    --repeats 21 --profile --graphs --batch ${BATCH:-1 8 32} --vocab ${VOCAB:-32000 49152} --json "$out/verify.json" \
    | tee "$out/verify.md" || status=1

# The fused kernels against float64 torch sums; then the law tests with the verifiers on the
# GPU, replayed from CUDA graphs as the service runs them (the tables, drafting and counting
# stay on the CPU;
# tests/harness.py reads BLOCKSPEC_TEST_DEVICE and BLOCKSPEC_TEST_GRAPHS); the graphs' own
# tests and the count of host waits. --noconftest: conftest.py only loads the service's
# fixtures (Ray, Redis), which these tests don't use.
BLOCKSPEC_TEST_DEVICE=cuda timeout "${LAWS_TIMEOUT:-320}" "$py" -m pytest -q -p no:cacheprovider \
    --noconftest -n "${WORKERS:-12}" -m "slow or not slow" \
    tests/test_verify_kernels.py tests/test_reference_laws.py tests/test_loop_lossless.py \
    tests/test_verify_graphs.py tests/test_verify_cost.py::test_cuda_host_waits_within_budget 2>&1 | tee "$out/laws.txt" || status=1
exit $status
