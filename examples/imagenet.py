"""Train a torchvision classifier on ImageNet (or fake data) with a monet_like schedule.

    python examples/imagenet.py --arch resnet50 --batch-size 184 \\
        --solution_file zoo:solution_resnet50_184_inplace_conv_multiway_newnode_10 [DATA]
    torchrun --nproc_per_node 2 examples/imagenet.py --arch resnet18 --batch-size 32 \\
        --image-size 64 --solution_file resnet18.json --steps 5

DATA is a folder in torchvision's ImageFolder layout (`train/CLASS/*.jpg`); without it
the images are torchvision's FakeData. `--solution_file` takes a schedule file or a zoo
name (`zoo:NAME`, see `python -m monet_like zoo list`); without it the model trains
eagerly, for comparison. The schedule fixes the per-process batch and the image size.
Under `torchrun` each process trains its share of the data with DistributedDataParallel
around the scheduled model (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torchvision import transforms

from monet_like import ScheduleWrapper
from monet_like.errors import UserError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", nargs="?", help="ImageFolder root (with train/); FakeData if absent")
    p.add_argument("--arch", default="resnet50", help="a torchvision.models builder name")
    p.add_argument("--batch-size", type=int, default=184, help="per process")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--solution_file", help="a schedule file or zoo:NAME; eager if absent")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: epochs)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=2, help="data loader processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def dataset(args: argparse.Namespace, classes: int):
    size = args.image_size
    if args.data is None:
        return torchvision.datasets.FakeData(
            size=max(1000, 4 * args.batch_size),
            image_size=(3, size, size),
            num_classes=classes,
            transform=transforms.ToTensor(),
            random_offset=args.seed,
        )
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    return torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        transforms.Compose(
            [
                transforms.RandomResizedCrop(size),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                normalize,
            ]
        ),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ
    rank = 0
    device = torch.device(args.device)
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        rank = dist.get_rank()
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    builder = getattr(torchvision.models, args.arch, None)
    if builder is None:
        print(f"error: torchvision.models has no {args.arch!r}", file=sys.stderr)
        return 2
    model = builder().to(device)
    classes = model.fc.out_features if hasattr(model, "fc") else 1000
    net: nn.Module = model
    if args.solution_file:
        # The wrapper shares the model's parameters; it refuses a schedule made for
        # another model, batch, input shape or dtype, in one line.
        try:
            net = ScheduleWrapper(model, args.solution_file, (3, args.image_size, args.image_size))
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if distributed:
        net = nn.parallel.DistributedDataParallel(net)

    data = dataset(args, classes)
    sampler = torch.utils.data.distributed.DistributedSampler(data) if distributed else None
    loader = torch.utils.data.DataLoader(
        data,
        batch_size=args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        num_workers=args.workers,
        drop_last=True,  # the schedule is for exactly this batch
        generator=torch.Generator().manual_seed(args.seed),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    step = 0
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for images, target in loader:
            started = time.perf_counter()
            images, target = images.to(device), target.to(device)
            loss = loss_fn(net(images), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0:
                print(
                    f"epoch {epoch} step {step} loss {loss.item():.6f}"
                    f" {time.perf_counter() - started:.2f} s",
                    flush=True,
                )
            if step == args.steps:
                break
        if step == args.steps:
            break
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
