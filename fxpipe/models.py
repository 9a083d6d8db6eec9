"""Small reference models for the demo, the tests and the benchmarks (CPU-sized)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "MLP", "MODELS", "VGG", "BundledModel", "ResNet", "bundled"]


class MLP(nn.Sequential):
    """Linear + ReLU layers: the simplest pipeline."""

    def __init__(self, widths: tuple[int, ...] = (32, 64, 64, 64, 64, 10)) -> None:
        layers: list[nn.Module] = []
        for i, (w_in, w_out) in enumerate(zip(widths[:-1], widths[1:])):
            layers.append(nn.Linear(w_in, w_out))
            if i < len(widths) - 2:
                layers.append(nn.ReLU())
        super().__init__(*layers)


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convolutions with BatchNorm and a skip connection."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class ResNet(nn.Module):
    """A CIFAR-style ResNet: skip connections and BatchNorm, 32x32 inputs."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), blocks: int = 1,
                 num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        layers, c_in = [], widths[0]
        for i, width in enumerate(widths):
            for j in range(blocks):
                layers.append(BasicBlock(c_in, width, 2 if (i > 0 and j == 0) else 1))
                c_in = width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class VGG(nn.Module):
    """A VGG-style CNN whose layers differ widely in cost, as VGG's do: the convolutions at full
    resolution cost the most, later ones less and less, and the classifier holds most of the
    parameters but little of the time. Equal numbers of layers per stage are far from equal
    time per stage."""

    def __init__(self, config: tuple = (16, 16, "M", 32, 32, "M", 64, "M", 64),
                 hidden: int = 512, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for item in config:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c_in, item, 3, padding=1), nn.ReLU()]
                c_in = item
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(c_in * 4 * 4, hidden), nn.ReLU(), nn.Dropout(0.1),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        shape = (batch, seq, self.heads, dim // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, dim))


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style decoder whose output projection shares the token embedding's weight."""

    def __init__(self, vocab: int = 128, seq: int = 32, dim: int = 64, heads: int = 4,
                 layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*(DecoderBlock(dim, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input/output embedding

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        return self.lm_head(self.ln_f(self.blocks(x)))


def _cross_entropy_tokens(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


@dataclasses.dataclass(frozen=True)
class BundledModel:
    """A reference model with a data generator and a loss, for demos, tests and benchmarks."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    needs: str | None = None  # the optional package that build() imports, if any


def _images(size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 3, 32, 32, generator=gen), torch.randint(0, 10, (size,), generator=gen)


def _vectors(size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 32, generator=gen), torch.randint(0, 10, (size,), generator=gen)


def _tokens(size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 128, (size, 33), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _hf_gpt2() -> nn.Module:
    config = _transformers().GPT2Config(
        n_layer=4, n_head=4, n_embd=128, vocab_size=128, n_positions=64, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return _transformers().GPT2LMHeadModel(config)


def _hf_bert() -> nn.Module:
    config = _transformers().BertConfig(
        num_hidden_layers=4, hidden_size=128, num_attention_heads=4, intermediate_size=512,
        vocab_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return _transformers().BertForMaskedLM(config)


def _transformers():
    """transformers, for the HuggingFace models (random weights from a config, no download)."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("the HuggingFace models need transformers: pip install "
                          "'fxpipe[hf]'") from e
    return transformers


def _hf_tokens_loss(output, target: torch.Tensor) -> torch.Tensor:
    return _cross_entropy_tokens(output.logits, target)


MODELS = {
    "resnet": BundledModel("resnet", ResNet, _images, F.cross_entropy),
    "vgg": BundledModel("vgg", VGG, _images, F.cross_entropy),
    "gpt": BundledModel("gpt", GPT, _tokens, _cross_entropy_tokens),
    "mlp": BundledModel("mlp", MLP, _vectors, F.cross_entropy),
    "hf-gpt2": BundledModel("hf-gpt2", _hf_gpt2, _tokens, _hf_tokens_loss, "transformers"),
    "hf-bert": BundledModel("hf-bert", _hf_bert, _tokens, _hf_tokens_loss, "transformers"),
}


def bundled(name: str) -> BundledModel:
    """The bundled model called `name` (one of MODELS)."""
    if name not in MODELS:
        raise KeyError(f"no bundled model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name]
