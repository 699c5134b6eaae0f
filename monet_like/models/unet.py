"""UNet (Ronneberger et al. 2015), MONeT's fifth benchmark model, built from code.

Padded 3x3 convolutions with BatchNorm and ReLU, max-pool down, transposed
convolution up, skip connections by concatenation. Spatial sizes must be
divisible by 2**depth.
"""

import torch
from torch import nn


class DoubleConv(nn.Sequential):
    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__(
            nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
        )


class UNet(nn.Module):
    def __init__(
        self, in_channels: int = 3, num_classes: int = 2, base: int = 64, depth: int = 4
    ) -> None:
        super().__init__()
        widths = [base * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList([DoubleConv(in_channels, widths[0])])
        self.down.extend(DoubleConv(widths[i], widths[i + 1]) for i in range(depth))
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ModuleList(
            nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2)
            for i in reversed(range(depth))
        )
        self.up_conv = nn.ModuleList(
            DoubleConv(2 * widths[i], widths[i]) for i in reversed(range(depth))
        )
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else self.pool(x))
            skips.append(x)
        skips.pop()
        for up, conv in zip(self.up, self.up_conv, strict=True):
            x = conv(torch.cat([skips.pop(), up(x)], dim=1))
        return self.head(x)
