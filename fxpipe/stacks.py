"""Torch's layer stacks (nn.TransformerEncoder, multi-layer RNNs) opened: a unit per layer."""

from __future__ import annotations

import functools
from collections.abc import Collection

import torch
from torch import nn

__all__ = ["RNNLayer", "unstacked"]


def unstacked(model: nn.Module, leaf_paths: Collection[str] = ()) -> nn.Module:
    """What to trace for `model`: itself, or a shallow copy whose layer stacks (but those kept
    whole) call their layers one by one, holding the model's modules and Parameters under the
    model's names; the model is not changed. (torch.fx keeps a torch.nn module whole.)"""
    return _open(model, "", frozenset(leaf_paths), {})


def _open(module: nn.Module, path: str, leaf_paths: frozenset[str], memo: dict) -> nn.Module:
    if path in leaf_paths or id(module) in memo:  # a module used at two paths stays one
        return memo.get(id(module), module)
    opener = _OPENERS.get(type(module))  # the exact type: a subclass may change forward
    hooked = module._forward_hooks or module._forward_pre_hooks  # expect it called whole
    if opener and not hooked and getattr(module, "num_layers", 2) > 1:
        opened = opener(module)
    elif type(module).__module__.startswith("torch.nn") and not isinstance(
            module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return module  # torch.fx calls it whole, so nothing in it may be a stand-in
    else:
        opened = module
    children = {name: _open(child, f"{path}.{name}" if path else name, leaf_paths, memo)
                for name, child in opened._modules.items() if child is not None}
    if opened is module and any(children[n] is not module._modules[n] for n in children):
        opened = object.__new__(type(module))  # a copy sharing all but its children
        vars(opened).update(vars(module))
    if opened is not module:
        vars(opened)["_modules"] = {**opened._modules, **children}
    memo[id(module)] = opened
    return opened


class _Opened(nn.Module):
    """Stands in for `original`, whose attributes and class forward() may read."""

    def __init__(self, original: nn.Module) -> None:
        vars(self)["_original"] = original  # not a submodule: its tensors are registered here
        super().__init__()

    def __getattr__(self, name: str):  # e.g. rnn.hidden_size
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(vars(self)["_original"], name)

    @property
    def __class__(self) -> type:  # isinstance(rnn, nn.LSTM) consults it
        return type(vars(self)["_original"])


class _Encoder(_Opened):
    """nn.TransformerEncoder's loop. Not its inference fast path, which with a padding mask
    zeroes the outputs at padded positions; a causal mask is applied as a mask."""

    def __init__(self, encoder: nn.TransformerEncoder) -> None:
        super().__init__(encoder)
        self.layers, self.norm = encoder.layers, encoder.norm

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        for layer in self.layers:
            src = layer(src, mask, src_key_padding_mask, bool(is_causal))
        return src if self.norm is None else self.norm(src)


class _RNN(_Opened):
    """A multi-layer nn.LSTM/GRU/RNN as one-layer calls on its Parameters, registered here
    under its names; h_n (and c_n) stacked from the layers' as it returns them."""

    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__(rnn)
        names, k = rnn._flat_weights_names, len(rnn._flat_weights_names) // rnn.num_layers
        self._parameters.update((name, getattr(rnn, name)) for name in names)
        self.names = [names[i * k:(i + 1) * k] for i in range(rnn.num_layers)]
        self.layers = nn.ModuleList(RNNLayer(rnn, i > 0) for i in range(rnn.num_layers))
        self.lstm, self.dirs = rnn.mode == "LSTM", 1 + rnn.bidirectional

    def forward(self, input, hx=None):
        x, states = input, []
        for i, layer in enumerate(self.layers):
            part = slice(i * self.dirs, (i + 1) * self.dirs)
            h = None if hx is None else [hx[0][part], hx[1][part]] if self.lstm else hx[part]
            out = layer(x, h, *[getattr(self, name) for name in self.names[i]])
            x = out[0]
            states.append([out[k] for k in range(1, 2 + self.lstm)])  # (out, h[, c]) unpacked
        last = [torch.cat(parts) for parts in zip(*states)]
        return x, tuple(last) if self.lstm else last[0]


class RNNLayer(nn.Module):
    """One layer of a multi-layer RNN, given its weights; the unit cut treats it as a leaf."""

    def __init__(self, rnn: nn.RNNBase, after_another: bool) -> None:
        super().__init__()
        self.op = {"LSTM": torch.lstm, "GRU": torch.gru, "RNN_TANH": torch.rnn_tanh,
                   "RNN_RELU": torch.rnn_relu}[rnn.mode]
        self.flags = (rnn.bias, rnn.bidirectional, rnn.batch_first)
        self.zeros = [(1 + rnn.bidirectional, rnn.proj_size or rnn.hidden_size)]
        self.zeros += [(1 + rnn.bidirectional, rnn.hidden_size)] * (rnn.mode == "LSTM")
        self.dropout = nn.Dropout(rnn.dropout) if after_another and rnn.dropout else None
        if self.dropout is not None:  # a module, so the mode is read at run time: the RNN's
            self.dropout.register_forward_pre_hook(functools.partial(_mode_of, rnn))

    def forward(self, x, hx, *weights):
        if self.dropout is not None:
            x = self.dropout(x)
        if hx is None:
            batch = x.size(0 if self.flags[2] else 1)
            hx = [x.new_zeros(dirs, batch, size) for dirs, size in self.zeros]
            hx = hx if len(hx) == 2 else hx[0]
        # train=True: in one layer it only keeps what backward needs (cuDNN, oneDNN); the
        # module's mode would be a constant in the graph
        bias, bidirectional, batch_first = self.flags
        return self.op(x, hx, list(weights), bias, 1, 0.0, True, bidirectional, batch_first)


def _mode_of(rnn: nn.RNNBase, dropout: nn.Dropout, args: tuple) -> None:
    dropout.train(rnn.training)


_OPENERS = {nn.TransformerEncoder: _Encoder, nn.LSTM: _RNN, nn.GRU: _RNN, nn.RNN: _RNN}
