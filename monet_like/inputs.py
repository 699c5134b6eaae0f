"""The input a model takes: its dtype (token ids for language models, from the model's
`input_dtype` attribute) and a random batch of it (ids below its `vocab_size`)."""

from __future__ import annotations

import torch
from torch import nn


def input_dtype(model: nn.Module, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the model's input: the model's `input_dtype` attribute, else `dtype`."""
    return getattr(model, "input_dtype", dtype)


def make_input(
    model: nn.Module,
    input_shape: tuple[int, ...],
    batch: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """A random input batch for `model`: floats, or token ids below `model.vocab_size`."""
    shape = (batch, *input_shape)
    in_dtype = input_dtype(model, dtype)
    if in_dtype.is_floating_point:
        return torch.randn(shape, dtype=in_dtype, device=device, generator=generator)
    high = int(getattr(model, "vocab_size", 2))
    return torch.randint(0, high, shape, dtype=in_dtype, device=device, generator=generator)
