"""The zero-bubble backward split: B then W give the unsplit backward's gradients, computing
each gradient of each autograd node once (W does not walk the activation path again)."""

from __future__ import annotations

import copy
import weakref
from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fxpipe.runtime.split_backward import input_backward, weight_backward


class Square(torch.autograd.Function):
    """x² with a backward that counts its calls."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        Square.calls += 1
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class Net(nn.Module):
    """Linear layers, a split and a join, a custom Function, an output that depends on a
    parameter only; `shared`: a layer used twice and a weight used directly twice."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a if shared else nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.randn(4))
        self.gain = self.scale if shared else nn.Parameter(torch.randn(4))
        self.norm = nn.LayerNorm(4)

    def forward(self, x, z):
        h = torch.relu(self.a(x))
        u, v = (h * self.scale).chunk(2, dim=1)
        h = self.b(torch.cat([torch.tanh(u), v * z], 1)) * self.gain
        return self.norm(h) + Square.apply(h), self.scale * 2, z


def _run(model, x, z, grads, split):
    """(input gradients, parameter gradients) of one backward, split into B and W or not."""
    model.zero_grad(set_to_none=True)
    leaves = [t.detach().requires_grad_() for t in (x, z)]
    outputs = model(*leaves)
    if split:
        found, work = input_backward(outputs, grads, leaves)
        weight_backward(work)
    else:
        torch.autograd.backward(outputs, grads)
        found = [leaf.grad for leaf in leaves]
    return found, {n: p.grad for n, p in model.named_parameters()}


@settings(max_examples=15, deadline=None)
@given(shared=st.booleans(), batch=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_b_then_w_give_the_unsplit_backwards_gradients(shared, batch, seed):
    torch.manual_seed(seed)
    model = Net(shared).double()
    x, z = torch.randn(batch, 4, dtype=torch.float64), torch.randn(batch, 2, dtype=torch.float64)
    grads = [torch.randn(batch, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64),
             torch.randn(batch, 2, dtype=torch.float64)]
    plain_inputs, plain_params = _run(model, x, z, grads, split=False)
    split_inputs, split_params = _run(model, x, z, grads, split=True)
    for got, want in zip(split_inputs, plain_inputs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    assert plain_params.keys() == split_params.keys()
    for name, want in plain_params.items():
        torch.testing.assert_close(split_params[name], want, rtol=1e-12, atol=1e-15, msg=name)


def test_w_alone_when_no_input_needs_a_gradient():
    """A first stage (its input needs no gradient): B computes nothing, W all."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, dtype=torch.float64)
    loss = model(x).sum()
    found, work = input_backward([loss], [None], [])
    assert found == () and all(p.grad is None for p in model.parameters())
    weight_backward(work)
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)


def _count_gradients(roots, log: Counter) -> None:
    """Count, per autograd node kind and edge, every gradient the graph below `roots` computes."""
    seen, stack = set(), [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        node.register_hook(lambda grads_in, _, node=node: log.update(
            (node.name(), i) for i, g in enumerate(grads_in) if g is not None))
        stack += [c for c, _ in node.next_functions if c is not None]


def test_b_and_w_compute_each_gradient_once_like_the_unsplit_backward():
    """Where no weight is shared between activation nodes, W computes only what B left: the
    gradients both compute, by node kind and edge, are the unsplit backward's."""
    model = Net(shared=False).double()
    x, z = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    grads = [torch.randn(3, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64),
             torch.randn(3, 2, dtype=torch.float64)]
    counts = []
    for split in (False, True):
        log: Counter = Counter()
        leaves = [t.detach().requires_grad_() for t in (x, z)]
        outputs = model(*leaves)
        _count_gradients(outputs, log)
        Square.calls = 0
        if split:
            weight_backward(input_backward(outputs, grads, leaves)[1])
        else:
            torch.autograd.backward(outputs, grads)
        assert Square.calls == 1  # an activation-only node runs once
        counts.append(log)
    assert counts[1] == counts[0]


def test_nothing_of_a_micro_batch_outlives_its_w():
    """Once W ran and the outputs are dropped, every tensor the forward saved is freed: the
    gradients B captured are not kept (and a discarded B, never followed by W, frees them too)."""
    model = Net(shared=True).double()
    x, z = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    for run_w in (True, False):
        saved = []

        def pack(tensor, saved=saved):
            held = tensor.detach()  # what the graph holds (the tensor itself would be a cycle)
            saved.append(weakref.ref(held))
            return held

        leaves = [t.detach().requires_grad_() for t in (x, z)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            outputs = model(*leaves)
        grads = [torch.ones_like(outputs[0]), torch.ones_like(outputs[1]), None]
        found, work = input_backward(outputs[:2], grads[:2], leaves)
        assert work.captured and saved
        if run_w:
            weight_backward(work)
        del outputs, work, found, leaves
        assert all(ref() is None for ref in saved), run_w
