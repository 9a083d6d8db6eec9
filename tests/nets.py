"""Random small networks drawn by hypothesis: MLPs, CNNs and residual nets with long skips."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn


class RandomMLP(nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class RandomCNN(nn.Module):
    """conv-BN-ReLU(-pool) blocks, then a linear classifier."""

    def __init__(self, channels: list[int], pools: list[bool], size: int = 8) -> None:
        super().__init__()
        blocks = []
        for c_in, c_out, pool in zip(channels[:-1], channels[1:], pools):
            layers = [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]
            if pool:
                layers.append(nn.MaxPool2d(2))
                size //= 2
            blocks.append(nn.Sequential(*layers))
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(channels[-1] * size * size, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class ResidualNet(nn.Module):
    """Residual blocks plus a long skip: the input is used again by the last layer."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Linear(6, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
            for _ in range(blocks)
        )
        self.skip = nn.Linear(6, width)
        self.out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(x)
        first = h
        for block in self.blocks:
            h = h + block(h)
        h = h + self.skip(x) + first  # skips over every stage between
        return self.out(F.relu(h)), first.mean()


@st.composite
def networks(draw) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A random network in float64 and an example input for it."""
    kind = draw(st.sampled_from(["mlp", "cnn", "residual"]))
    batch = draw(st.integers(2, 4))
    if kind == "mlp":
        widths = draw(st.lists(st.integers(2, 9), min_size=3, max_size=7))
        model, x = RandomMLP(widths), torch.randn(batch, widths[0])
    elif kind == "cnn":
        depth = draw(st.integers(1, 3))
        channels = draw(st.lists(st.integers(1, 4), min_size=depth + 1, max_size=depth + 1))
        pools = draw(st.lists(st.booleans(), min_size=depth, max_size=depth))
        model, x = RandomCNN(channels, pools), torch.randn(batch, channels[0], 8, 8)
    else:
        model = ResidualNet(draw(st.integers(2, 6)), draw(st.integers(1, 4)))
        x = torch.randn(batch, 6)
    return model.double(), (x.double(),)


def flat_outputs(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def scalar_loss(out) -> torch.Tensor:
    return sum((o.double() ** 2).sum() for o in flat_outputs(out))
