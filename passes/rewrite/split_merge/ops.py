"""Which operators act on each channel alone, and how: the table propagation and emission read."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

__all__ = ["BN_MODULES", "channel_op"]

_UNARY = {
    "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "gelu", "silu", "mish", "sigmoid",
    "tanh", "hardtanh", "hardswish", "hardsigmoid", "softplus", "softsign", "tanhshrink",
    "logsigmoid", "log_sigmoid", "threshold", "hardshrink", "softshrink", "dropout",
    "alpha_dropout", "exp", "abs", "neg", "square", "sqrt", "rsqrt", "clamp", "clip",
    "clamp_min", "clamp_max", "contiguous", "clone",
}
_CHANNEL_DROPOUT = {"dropout1d", "dropout2d", "dropout3d", "feature_dropout",
                    "feature_alpha_dropout"}  # drop whole channels: per channel along dim 1
_BINARY = {"add", "sub", "mul", "div", "true_divide", "truediv", "maximum", "minimum", "pow",
           "rsub", "iadd", "isub", "imul", "itruediv"}
_POOLS = {f"{kind}_pool{k}d": k for k in (1, 2, 3)
          for kind in ("max", "avg", "adaptive_avg", "adaptive_max", "lp", "_adaptive_avg")}
_BATCH_NORM = {"batch_norm"}
_FUNCTION_NAMES: dict[Any, str] = {
    getattr(namespace, name): name
    for name in (*_UNARY, *_CHANNEL_DROPOUT, *_BINARY, *_POOLS, *_BATCH_NORM, "flatten")
    for namespace in (torch, F)
    if callable(getattr(namespace, name, None))
}
_FUNCTION_NAMES.update({operator.add: "add", operator.sub: "sub", operator.mul: "mul",
                        operator.truediv: "div", operator.pow: "pow", operator.iadd: "iadd",
                        operator.isub: "isub", operator.imul: "imul",
                        operator.itruediv: "itruediv"})

_UNARY_MODULES = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign,
    nn.Tanhshrink, nn.LogSigmoid, nn.Threshold, nn.Hardshrink, nn.Softshrink, nn.Identity,
    nn.Dropout, nn.AlphaDropout,
)
_CHANNEL_MODULES = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.FeatureAlphaDropout)
_POOL_MODULES = {
    nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3, nn.AvgPool1d: 1, nn.AvgPool2d: 2,
    nn.AvgPool3d: 3, nn.AdaptiveAvgPool1d: 1, nn.AdaptiveAvgPool2d: 2, nn.AdaptiveAvgPool3d: 3,
    nn.AdaptiveMaxPool1d: 1, nn.AdaptiveMaxPool2d: 2, nn.AdaptiveMaxPool3d: 3, nn.LPPool1d: 1,
    nn.LPPool2d: 2,
}
BN_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def channel_op(node: fx.Node, gm: fx.GraphModule) -> tuple[str, int] | None:
    """(kind, spatial dims) of a node that may act per channel; None for any other node."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if isinstance(module, BN_MODULES):
            return "batch_norm", 0
        if isinstance(module, _CHANNEL_MODULES):
            return "channel", 0
        if isinstance(module, _UNARY_MODULES):
            return "unary", 0
        if type(module) in _POOL_MODULES:
            return "pool", _POOL_MODULES[type(module)]
        if isinstance(module, nn.Flatten):
            return "flatten", 0
        return None
    if node.op == "call_method":
        name = node.target.removesuffix("_") if node.target != "size" else "size"
    elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        name = node.target.overloadpacket.__name__.removesuffix("_")
        if name == "sym_size":
            name = "size"
    elif node.op == "call_function":
        name = _FUNCTION_NAMES.get(node.target)
    else:
        return None
    if name in _UNARY:
        return "unary", 0
    if name in _CHANNEL_DROPOUT:
        return "channel", 0
    if name in _BINARY:
        return "binary", 0
    if name in _POOLS:
        return "pool", _POOLS[name]
    if name in ("batch_norm", "flatten", "size"):
        return name, 0
    return None
