#!/usr/bin/env bash
# The checks that need a GPU, in one call (a lent GPU machine has minutes, not hours; 1b
# and 2c have not run on a GPU yet, the others ran on an H200 in about 4 minutes):
#   1. MONeT's ResNet-50 configuration (batch 184, 224 px) at full size: profiled and
#      solved on this GPU at 10 GB (normal), replayed: peak against prediction, gradients
#      against eager, step time against eager beside the predicted overhead;
#   1b. whether timing ops one by one overstates the step (scripts/gpu_timing_probe.py);
#   2. one small replay on CUDA (ResNet-18, full mode): measured peak (the CUDA caching
#      allocator) against the predicted peak and the budget, gradients against eager;
#      then the allocator's bytes per step and TF32 on and off (scripts/gpu_replay_probe.py);
#   2c. a Hugging Face GPT-2 (attention kernels, dropout) solved and replayed on CUDA;
#   3. the same model in the full mode at 8 GB (cuDNN algorithms, the CUDA kernels) solved
#      and replayed, and the zoo's CPU schedule refused on CUDA (another graph there);
#   4. the CUDA kernels built and compared with their references on the GPU;
#      GPU_CHECK_THROW_PROBE=1 adds whether an error thrown in nvcc-compiled code reaches
#      Python, per host compiler (scripts/gpu_throw_probe.py; minutes of builds);
#   5. the zoo's entries against their index.
# Usage: bash scripts/gpu_check.sh   (after install.sh; prints one block per check)
# GPU_CHECK_OUT=DIR keeps the solved schedules and the profile cache there.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# scripts/*.py import the package from the checkout when it is not installed (a bare GPU image)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${GPU_CHECK_OUT:-$(mktemp -d)}
mkdir -p "$out"
export MONET_LIKE_CACHE="$out/cache"
status=0
stage() { echo "== $1 [$(date +%T)]"; }
stage "nvidia-smi"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || status=1
"$PY" -c 'import torch, highspy, monet_like; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' || exit 1
stage "1. ResNet-50, batch 184, 224 px: profiled and solved on CUDA at 10 GB (normal), replayed"
r50=("torchvision.models.resnet50()" 184 10 normal HIGHS --input_shape 3,224,224 --device cuda)
timeout 300 "$PY" solve.py "${r50[@]}" --time_limit 90 --no_zoo --output "$out/r50_cuda_10.json" --force \
  && timeout 180 "$PY" schedule.py "${r50[@]}" --solution_file "$out/r50_cuda_10.json" \
       --run_bs --check_diff --check_runtime --iterations 10 || status=1
stage "1b. the ops timed one by one against eager's step, and with the GPU kept busy"
timeout 120 "$PY" scripts/gpu_timing_probe.py --mode normal || status=1
timeout 120 "$PY" scripts/gpu_timing_probe.py --mode inplace_conv_multiway_newnode || status=1
stage "2. replay on CUDA: ResNet-18, batch 32, 64 px, full mode at 0.123 GB"
timeout 300 "$PY" solve.py "torchvision.models.resnet18()" 32 0.123 inplace_conv_multiway_newnode HIGHS \
    --input_shape 3,64,64 --device cuda --time_limit 60 --no_zoo --output "$out/gpu.json" --force || status=1
timeout 120 "$PY" schedule.py "torchvision.models.resnet18()" 32 0.123 inplace_conv_multiway_newnode HIGHS \
    --input_shape 3,64,64 --device cuda --solution_file "$out/gpu.json" --run_bs --check_diff || status=1
stage "2b. where the replay's memory goes; TF32 on and off"
timeout 120 "$PY" scripts/gpu_replay_probe.py "$out/gpu.json" || status=1
stage "2c. a Hugging Face GPT-2 on CUDA (its attention kernels, dropout) at 0.4 GB (store-all about 0.7)"
gpt=("transformers.gpt2(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, n_positions=256, bos_token_id=0, eos_token_id=0)"
     16 0.4 normal HIGHS --input_shape 256 --device cuda)
timeout 150 "$PY" solve.py "${gpt[@]}" --time_limit 60 --no_zoo --output "$out/gpt2_cuda.json" --force \
  && timeout 90 "$PY" schedule.py "${gpt[@]}" --solution_file "$out/gpt2_cuda.json" --run_bs --check_diff \
  || status=1
stage "3. ResNet-50, batch 184: the full mode at 8 GB on CUDA; the zoo's CPU schedule refused there"
full=("torchvision.models.resnet50()" 184 8 inplace_conv_multiway_newnode HIGHS --input_shape 3,224,224
      --device cuda)
timeout 200 "$PY" solve.py "${full[@]}" --time_limit 40 --no_zoo --output "$out/r50_cuda_full_8.json" --force \
  && timeout 120 "$PY" schedule.py "${full[@]}" --solution_file "$out/r50_cuda_full_8.json" \
       --run_bs --check_diff --check_runtime --iterations 5 || status=1
refusal=$(timeout 120 "$PY" schedule.py "torchvision.models.resnet50()" 184 5 normal HIGHS \
  --input_shape 3,224,224 --device cuda --solution_file zoo:solution_resnet50_184_normal_5 2>&1)
echo "$refusal" | tail -1
echo "$refusal" | grep -q "solved on cpu" || status=1
stage "4. CUDA kernels"
timeout 300 "$PY" -m pytest -q -n0 tests/test_cuda_build.py -p no:cacheprovider || status=1
if [ "${GPU_CHECK_THROW_PROBE:-0}" = 1 ]; then
  stage "4b. a C++ exception from nvcc-compiled code, by host compiler"
  timeout 400 "$PY" scripts/gpu_throw_probe.py || status=1
fi
stage "5. zoo entries"
timeout 120 "$PY" -m monet_like zoo verify || status=1
stage "gpu_check exit $status"
exit $status
