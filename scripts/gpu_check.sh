#!/usr/bin/env bash
# The checks that need a GPU, in one call (a lent GPU machine has minutes, not hours):
#   1. the CUDA kernels built and compared with their references on the GPU;
#   1b. whether an error thrown in nvcc-compiled code reaches Python, per host compiler;
#   2. one replay on CUDA: measured peak (the CUDA caching allocator) against the
#      predicted peak and the budget, and gradients against eager PyTorch;
#      then the allocator's bytes per step (first and second, replay and eager) and the
#      differences with TF32 on and off (scripts/gpu_replay_probe.py);
#   3. the zoo's entries simulated within their budgets (they are profiled on the CPU:
#      a GPU solve of the same configuration is a separate profile).
# Usage: bash scripts/gpu_check.sh   (after install.sh; prints one block per check)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# scripts/*.py import the package from the checkout when it is not installed (a bare GPU image)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
echo "== nvidia-smi"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || status=1
echo "== 1. CUDA kernels"
timeout 300 "$PY" -m pytest -q -n0 tests/test_cuda_build.py -p no:cacheprovider || status=1
echo "== 1b. a C++ exception from nvcc-compiled code, by host compiler"
timeout 400 "$PY" scripts/gpu_throw_probe.py || status=1
echo "== 2. replay on CUDA: ResNet-18, batch 32, 64 px, full mode at 0.123 GB"
out=$(mktemp -d)
timeout 300 "$PY" solve.py "torchvision.models.resnet18()" 32 0.123 inplace_conv_multiway_newnode HIGHS \
    --input_shape 3,64,64 --device cuda --time_limit 60 --no_zoo --output "$out/gpu.json" --force || status=1
timeout 120 "$PY" schedule.py "torchvision.models.resnet18()" 32 0.123 inplace_conv_multiway_newnode HIGHS \
    --input_shape 3,64,64 --device cuda --solution_file "$out/gpu.json" --run_bs --check_diff || status=1
echo "== 2b. where the replay's memory goes; TF32 on and off"
timeout 120 "$PY" scripts/gpu_replay_probe.py "$out/gpu.json" || status=1
echo "== 3. zoo entries"
timeout 120 "$PY" -m monet_like zoo verify || status=1
echo "== gpu_check exit $status"
exit $status
