"""Symbolic pass: FLOPs and output bytes of every node as sympy expressions of the batch size."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
import sympy
import torch
from torch import fx
from torch.utils import flop_counter

from fxpipe.batching import input_dims, resize
from fxpipe.meta import SYMBOLIC, ValueInfo
from fxpipe.passes.analysis.shape import record_values
from fxpipe.units import Unit

__all__ = ["BATCH", "SEQ", "SYMBOLIC", "SymbolicCost", "annotate_symbolic", "flops_of_units",
           "unit_flops"]

BATCH = sympy.Symbol("b", positive=True, integer=True)
SEQ = sympy.Symbol("s", positive=True, integer=True)

Shape = tuple[sympy.Expr, ...]


@dataclasses.dataclass(frozen=True)
class SymbolicCost:
    """One node's cost as expressions of the batch size `b` (and sequence length `s`)."""

    flops: sympy.Expr
    out_bytes: sympy.Expr
    shapes: tuple[Shape, ...]  # symbolic shape of each tensor the node produces
    op: str
    warning: str | None = None


def annotate_symbolic(gm: fx.GraphModule, flat_inputs: Sequence[Any],
                      whole: Collection[int] = ()) -> list[str]:
    """Write a SymbolicCost under node.meta[SYMBOLIC] for every node; return the warnings.
    Inputs at positions in `whole` keep their size when the batch is probed.

    Shapes become expressions by probing: the graph runs at the example batch B and at a
    second batch (and, for token inputs, a second sequence length), and every dimension is
    fitted exactly as d0 + β(b − B) + γ(s − T) + δ(b − B)(s − T). FLOPs follow per operator from
    those shapes with torch.utils.flop_counter's conventions; an operator without a rule counts
    0 FLOPs and leaves a warning, never a failure.
    """
    base, shapes, warnings = _symbolic_shapes(gm, flat_inputs, whole)
    for node in gm.graph.nodes:
        op = _op_name(gm, node)
        outs = shapes.get(node.name, ())
        rule = _RULES.get(op)
        warning = None
        if rule is None:
            flops = sympy.Integer(0)
            if op not in _FREE:
                warning = f"no FLOP rule for {op!r} (node {node.name}); counted as 0"
                warnings.append(warning)
        else:
            try:
                flops = sympy.expand(rule(gm, node, shapes, outs))
            except Exception as e:  # a rule that cannot read this call's shapes must not fail
                flops = sympy.Integer(0)
                warning = f"FLOP rule for {op!r} failed on node {node.name}: {e}"
                warnings.append(warning)
        itemsizes = [t.dtype.itemsize for t in base[node.name].tensors]
        out_bytes = sum((_numel(shape) * size for shape, size in zip(outs, itemsizes)),
                        sympy.Integer(0))
        node.meta[SYMBOLIC] = SymbolicCost(flops, sympy.expand(out_bytes), outs, op, warning)
    return warnings


def unit_flops(gm: fx.GraphModule, units: Sequence[Unit]) -> list[sympy.Expr]:
    """Total FLOPs of each unit (after annotate_symbolic)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    return [sympy.expand(sum((nodes[name].meta[SYMBOLIC].flops for name in unit.nodes),
                             sympy.Integer(0))) for unit in units]


def flops_of_units(gm: fx.GraphModule, units: Sequence[Unit], flat_inputs: Sequence[Any],
                   whole: Collection[int] = ()) -> Callable[[float], np.ndarray]:
    """Annotate `gm` and return m -> the (K,) FLOPs of each unit at micro-batch size m (the
    sequence length stays the example's)."""
    annotate_symbolic(gm, flat_inputs, whole)
    seq = input_dims(flat_inputs, whole).seq or 1
    exprs = [e.subs(SEQ, seq) for e in unit_flops(gm, units)]
    evaluate = sympy.lambdify(BATCH, exprs, "numpy")
    return lambda m: np.array([float(v) for v in evaluate(m)], dtype=np.float64)


# --- symbolic shapes by probing ---------------------------------------------------------------

def _symbolic_shapes(gm: fx.GraphModule, flat_inputs: Sequence[Any], whole: Collection[int]):
    """Every node's ValueInfo at the example, its symbolic shapes, and probing warnings."""
    dims = input_dims(flat_inputs, whole)
    base = record_values(gm, flat_inputs)
    warnings: list[str] = []
    batch2 = dims.batch // 2 if dims.batch >= 4 else 2 * dims.batch
    probes = {"b": (batch2, None)}
    if dims.seq is not None and dims.seq >= 4:
        probes["s"] = (None, dims.seq // 2)
        probes["bs"] = (batch2, dims.seq // 2)
    runs: dict[str, dict[str, ValueInfo]] = {}
    for key, (batch, seq) in probes.items():
        try:
            runs[key] = record_values(gm, resize(flat_inputs, dims, batch, seq))
        except Exception as e:  # some models only run at one batch size: keep that size fixed
            warnings.append(f"shapes at another {'batch size' if 'b' in key else 'length'} "
                            f"could not be probed ({type(e).__name__}: {e}); kept constant")
    seq2 = probes["s"][1] if "s" in runs else None
    shapes: dict[str, tuple[Shape, ...]] = {}
    for name, info in base.items():
        shapes[name] = tuple(
            tuple(_fit_dim(name, t, d, info, runs, dims.batch, batch2, dims.seq, seq2)
                  for d in range(len(tensor.shape)))
            for t, tensor in enumerate(info.tensors)
        )
    return base, shapes, warnings


def _fit_dim(name, t, d, info, runs, batch, batch2, seq, seq2) -> sympy.Expr:
    d00 = sympy.Integer(info.tensors[t].shape[d])

    def probe(key: str) -> sympy.Expr | None:
        run = runs.get(key)
        if run is None or name not in run or len(run[name].tensors) != len(info.tensors):
            return None
        shape = run[name].tensors[t].shape
        return sympy.Integer(shape[d]) if len(shape) == len(info.tensors[t].shape) else None

    expr = d00
    d10 = probe("b")
    if d10 is not None:
        expr += sympy.Rational(d10 - d00, batch2 - batch) * (BATCH - batch)
    d01, d11 = probe("s"), probe("bs")
    if d01 is not None:
        expr += sympy.Rational(d01 - d00, seq2 - seq) * (SEQ - seq)
        if d10 is not None and d11 is not None:
            cross = sympy.Rational(d11 - d10 - d01 + d00, (batch2 - batch) * (seq2 - seq))
            expr += cross * (BATCH - batch) * (SEQ - seq)
    return sympy.expand(expr)


def _numel(shape: Shape) -> sympy.Expr:
    return math.prod(shape, start=sympy.Integer(1))


# --- operator names and FLOP rules ------------------------------------------------------------

_MODULE_OPS = {
    torch.nn.Linear: "linear", torch.nn.Conv1d: "conv", torch.nn.Conv2d: "conv",
    torch.nn.Conv3d: "conv", torch.nn.ConvTranspose1d: "conv_transpose",
    torch.nn.ConvTranspose2d: "conv_transpose", torch.nn.ConvTranspose3d: "conv_transpose",
    torch.nn.Embedding: "embedding", torch.nn.MultiheadAttention: "multi_head_attention",
    torch.nn.Flatten: "flatten", torch.nn.Identity: "identity", torch.nn.Unflatten: "flatten",
}
_MODULE_FAMILIES = (
    ((torch.nn.modules.batchnorm._NormBase, torch.nn.LayerNorm, torch.nn.GroupNorm,
      torch.nn.RMSNorm), "layer_norm"),
    ((torch.nn.modules.pooling._MaxPoolNd, torch.nn.modules.pooling._AvgPoolNd,
      torch.nn.modules.pooling._AdaptiveAvgPoolNd, torch.nn.modules.pooling._AdaptiveMaxPoolNd),
     "pool"),
    ((torch.nn.modules.dropout._DropoutNd,), "dropout"),
    ((torch.nn.Softmax, torch.nn.LogSoftmax), "softmax"),
    ((torch.nn.ReLU, torch.nn.GELU, torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.SiLU,
      torch.nn.LeakyReLU, torch.nn.ELU, torch.nn.Hardtanh, torch.nn.ReLU6, torch.nn.Mish,
      torch.nn.Softplus, torch.nn.Hardswish), "relu"),
)


def _op_name(gm: fx.GraphModule, node: fx.Node) -> str:
    """A normalised operator name: 'conv', 'linear', 'add', ... for modules, functions, aten."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        for cls, name in _MODULE_OPS.items():
            if type(module) is cls:
                return name
        for classes, name in _MODULE_FAMILIES:
            if isinstance(module, classes):
                return name
        return type(module).__name__
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            name = target.overloadpacket.__name__
        else:
            name = getattr(target, "__name__", str(target))
        name = name.rstrip("_") if not name.startswith("_") else name.lstrip("_").rstrip("_")
        return _ALIASES.get(name, name)
    return node.op  # placeholder, get_attr, output


_ALIASES = {
    "conv1d": "conv", "conv2d": "conv", "conv3d": "conv", "convolution": "conv",
    "conv_transpose1d": "conv_transpose", "conv_transpose2d": "conv_transpose",
    "conv_transpose3d": "conv_transpose", "matmul": "mm", "bmm": "mm", "baddbmm": "addmm",
    "scaled_dot_product_flash_attention_for_cpu": "scaled_dot_product_attention",
    "scaled_dot_product_efficient_attention": "scaled_dot_product_attention",
    "scaled_dot_product_flash_attention": "scaled_dot_product_attention",
    "batch_norm": "layer_norm", "native_batch_norm": "layer_norm", "group_norm": "layer_norm",
    "instance_norm": "layer_norm", "native_layer_norm": "layer_norm", "rms_norm": "layer_norm",
    "native_batch_norm_legit_functional": "layer_norm", "native_batch_norm_legit": "layer_norm",
    "native_group_norm": "layer_norm", "log_softmax": "softmax",
    "max_pool1d": "pool", "max_pool2d": "pool", "max_pool3d": "pool", "avg_pool1d": "pool",
    "avg_pool2d": "pool", "avg_pool3d": "pool", "adaptive_avg_pool1d": "pool",
    "adaptive_avg_pool2d": "pool", "adaptive_avg_pool3d": "pool", "adaptive_max_pool2d": "pool",
    "max_pool2d_with_indices": "pool", "mean": "sum", "amax": "sum", "max": "sum",
}

_POINTWISE = {
    "relu", "gelu", "tanh", "sigmoid", "silu", "leaky_relu", "elu", "hardtanh", "relu6",
    "mish", "softplus", "hardswish", "add", "sub", "mul", "truediv", "div", "neg", "pow",
    "exp", "log", "sqrt", "rsqrt", "dropout", "clamp", "where", "masked_fill", "eq", "ne",
    "lt", "gt", "le", "ge", "abs", "erf", "iadd", "imul", "floordiv", "mod", "native_dropout",
    "bernoulli", "rsub", "reciprocal", "square", "copy", "clone", "type_as", "float", "to",
}
_FREE = {
    "placeholder", "get_attr", "output", "view", "reshape", "permute", "transpose", "flatten",
    "unflatten", "squeeze", "unsqueeze", "expand", "contiguous", "getitem", "getattr", "size",
    "split", "chunk", "slice", "select", "t", "detach", "cat", "stack", "arange", "zeros",
    "ones", "full", "empty", "assert", "guards_fn", "alias", "lift_fresh_copy", "identity",
    "set_grad_enabled", "split_with_sizes", "unbind", "dim", "embedding", "zeros_like",
    "ones_like", "new_zeros", "new_ones", "tensor", "scalar_tensor", "sym_size", "_assert",
    "expand_as", "view_as", "reshape_as", "tril", "triu", "narrow", "index_select",
    "sym_constrain_range_for_size", "sym_numel", "sym_stride", "GuardsFn",
}


def _arg_shape(node: fx.Node, i: int, shapes) -> Shape:
    arg = node.args[i]
    return shapes[arg.name][0]


def _linear(gm, node, shapes, outs) -> sympy.Expr:
    if node.op == "call_module":
        weight = tuple(gm.get_submodule(node.target).weight.shape)
    else:
        weight = _arg_shape(node, 1, shapes)
    x = _arg_shape(node, 0, shapes)
    return 2 * _numel(x[:-1]) * weight[0] * weight[1]


def _conv(transposed: bool) -> Callable[..., sympy.Expr]:
    def rule(gm, node, shapes, outs) -> sympy.Expr:
        if node.op == "call_module":
            weight = tuple(gm.get_submodule(node.target).weight.shape)
        else:
            weight = _arg_shape(node, 1, shapes)
        x = _arg_shape(node, 0, shapes)
        return flop_counter.conv_flop_count(list(x), list(weight), list(outs[0]), transposed)
    return rule


def _mm(gm, node, shapes, outs) -> sympy.Expr:
    return 2 * _numel(outs[0]) * _arg_shape(node, 0, shapes)[-1]


def _addmm(gm, node, shapes, outs) -> sympy.Expr:
    return 2 * _numel(outs[0]) * _arg_shape(node, 1, shapes)[-1]


def _attention(gm, node, shapes, outs) -> sympy.Expr:
    q, k, v = (_arg_shape(node, i, shapes) for i in range(3))
    if len(q) == len(k) == len(v) == 4:
        return flop_counter.sdpa_flop_count(q, k, v)
    return 2 * _numel(q[:-1]) * k[-2] * (q[-1] + v[-1])


def _multi_head_attention(gm, node, shapes, outs) -> sympy.Expr:
    module = gm.get_submodule(node.target)
    x = _arg_shape(node, 0, shapes)
    tokens, length, dim = _numel(x[:-1]), x[1] if module.batch_first else x[0], x[-1]
    projections = 2 * tokens * dim * 3 * dim + 2 * tokens * dim * dim
    return projections + 4 * tokens * length * dim  # scores and weighted values


def _per_output(factor: int) -> Callable[..., sympy.Expr]:
    return lambda gm, node, shapes, outs: factor * _numel(outs[0]) if outs else sympy.Integer(0)


def _per_input(gm, node, shapes, outs) -> sympy.Expr:
    return _numel(_arg_shape(node, 0, shapes))


_RULES: dict[str, Callable[..., sympy.Expr]] = {
    "linear": _linear, "conv": _conv(False), "conv_transpose": _conv(True), "mm": _mm,
    "addmm": _addmm, "scaled_dot_product_attention": _attention,
    "multi_head_attention": _multi_head_attention, "layer_norm": _per_output(5),
    "softmax": _per_output(5), "pool": _per_input, "sum": _per_input,
    **{name: _per_output(1) for name in _POINTWISE},
}
