"""Where a CUDA replay's memory goes, for scripts/gpu_check.sh: the allocator's bytes before,
at the peak of and after two replayed steps and two eager ones (the first step of a process
makes cuBLAS's and cuDNN's persistent workspaces), and the replay's differences from eager
PyTorch with TF32 on and off.

Usage: python scripts/gpu_replay_probe.py SOLUTION_FILE   (ResNet-18, batch 32, 3x64x64)
"""

from __future__ import annotations

import copy
import sys

import torch
import torchvision

from monet_like.verify import compare_with_eager
from monet_like.wrapper import ScheduleWrapper

MIB = 2**20


def steps(name: str, net, model, x, predicted: int | None) -> None:
    for i in range(2):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = net(x)
        out.sum().backward()
        del out
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        print(
            f"{name} step {i}: before {base / MIB:.2f} MiB, peak"
            f" {stats['allocated_bytes.all.peak'] / MIB:.2f} (requested"
            f" {stats['requested_bytes.all.peak'] / MIB:.2f}), after"
            f" {torch.cuda.memory_allocated() / MIB:.2f} MiB"
            + (f"; predicted {predicted / MIB:.2f} MiB" if predicted else "")
        )
    model.zero_grad(set_to_none=True)


def main(path: str) -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18().cuda()
    x = torch.randn(32, 3, 64, 64, device="cuda")
    print(f"parameters, buffers and input: {torch.cuda.memory_allocated() / MIB:.2f} MiB")
    wrapped = ScheduleWrapper(copy.deepcopy(model), path, (3, 64, 64))
    steps("replay", wrapped, wrapped.model, x, wrapped.solution.predicted_peak_bytes)
    eager = copy.deepcopy(model)
    steps("eager", eager, eager, x, None)
    for tf32 in (True, False):
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
        diff = compare_with_eager(model, path, (3, 64, 64), x)
        print(
            f"TF32 {'on' if tf32 else 'off'}: output {diff.max_abs_output_diff:.3g}, gradient"
            f" {diff.max_rel_grad_diff:.3g} relative, buffers {diff.max_abs_buffer_diff:.3g}"
        )


if __name__ == "__main__":
    main(sys.argv[1])
