"""A loss the model computes itself (labels=), joined over micro-batches as the plain model's."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe.compiler.model_loss import decide

VOCAB = 11


class TokenModel(nn.Module):
    """A tiny language model whose forward returns (loss, logits) given labels, the loss
    reduced by `rule`, as HuggingFace models do."""

    def __init__(self, rule: str, dropout: float = 0.0) -> None:
        super().__init__()
        self.rule = rule
        self.embed = nn.Embedding(VOCAB, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, 8))
        self.head = nn.Linear(8, VOCAB)

    def forward(self, idx, labels=None):
        logits = self.head(self.body(self.embed(idx)))
        if labels is None:
            return logits
        flat = logits.reshape(-1, VOCAB)
        if self.rule == "shifted":  # a causal LM's: position t predicts label t + 1
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        elif self.rule == "tokens":
            loss = F.cross_entropy(flat, labels.reshape(-1))
        elif self.rule == "sum":
            loss = F.cross_entropy(flat, labels.reshape(-1), reduction="sum")
        elif self.rule == "samples":  # each sample's token mean, averaged over samples
            loss = F.cross_entropy(flat, labels.reshape(-1), reduction="none").view(
                labels.shape).mean(1).mean()
        else:  # the largest token loss: no join of micro-batches' values makes the batch's
            loss = F.cross_entropy(flat, labels.reshape(-1), reduction="none").max()
        return loss, logits


def _labels(draw, batch: int, length: int) -> torch.Tensor:
    labels = torch.randint(0, VOCAB, (batch, length))
    for row in range(batch):  # padding: a row's tail ignored, or all of it
        start = draw(st.integers(0, length))
        labels[row, start:] = -100
    return labels


@settings(max_examples=12)
@given(rule=st.sampled_from(["shifted", "tokens", "sum", "samples"]),
       micro_batches=st.integers(2, 4), extra=st.integers(0, 3), data=st.data())
def test_a_loss_the_model_computes_joins_over_micro_batches_as_the_plain_models(
        rule, micro_batches, extra, data):
    model = TokenModel(rule).double()
    batch, length = micro_batches + extra, 5
    example = torch.randint(0, VOCAB, (batch, length))
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=micro_batches,
                                             costs="none"),
                          example_inputs=(example,), example_kwargs={"labels": example})
    reference = copy.deepcopy(model)
    idx = torch.randint(0, VOCAB, (batch, length))
    labels = _labels(data.draw, batch, length)
    expected_loss, expected_logits = reference(idx, labels=labels)
    loss, logits = pipe(idx, labels=labels)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-12, atol=1e-12)
    if math.isnan(expected_loss.item()):  # a mean over nothing counted: so is ours
        assert math.isnan(loss.item())
        return
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-12)
    loss.backward()
    expected_loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("rule", ["shifted", "tokens", "sum", "samples"])
def test_the_join_is_found_in_eval_mode_and_the_models_modes_are_left_as_they_were(rule):
    model = TokenModel(rule, dropout=0.5).double()  # dropout would make the probe's runs differ
    model.body[2].eval()  # a mode of its own, kept
    example = torch.randint(0, VOCAB, (4, 6))
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2, costs="none"),
                          example_inputs=(example,), example_kwargs={"labels": example})
    how = {"shifted": "a mean over the entries of labels other than -100 after each row's first",
           "tokens": "a mean over the entries of labels other than -100",
           "sum": "the sum of", "samples": "a mean over samples"}[rule]
    assert f"model output #0 (one number) joins over micro-batches as {how}" in repr(pipe)
    assert [m.training for m in model.modules()] == [True] * 5 + [False, True, True]


def test_a_loss_that_is_no_join_of_its_micro_batches_is_refused_at_compile_with_the_fix():
    example = torch.randint(0, VOCAB, (4, 6))
    with pytest.raises(fxpipe.PlanError, match=r"model output #0 is one number .* neither the "
                       r"sum nor a mean .*Plan\(loss_fn=...\).*or use micro_batches=1"):
        fxpipe.compile(TokenModel("max"), fxpipe.Plan(stages=2, micro_batches=2, costs="none"),
                       example_inputs=(example,), example_kwargs={"labels": example})


class Regression(nn.Module):
    """A model returning its own loss without labels: a mean or a sum of its outputs."""

    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.reduction = reduction
        self.layers = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))

    def forward(self, x):
        out = self.layers(x)
        penalty = out.square().sum() if self.reduction == "sum" else out.square().mean()
        return out, penalty


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_one_number_output_without_labels_joins_as_a_mean_over_samples_or_a_sum(reduction):
    model = Regression(reduction).double()
    reference = copy.deepcopy(model)
    x = torch.randn(7, 3, dtype=torch.float64)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=3, costs="none"),
                          example_inputs=(x,))
    how = {"mean": "a mean over samples", "sum": "the sum of"}[reduction]
    assert f"model output #1 (one number) joins over micro-batches as {how}" in repr(pipe)
    (out, penalty), (expected_out, expected_penalty) = pipe(x), reference(x)
    torch.testing.assert_close(penalty, expected_penalty, rtol=1e-12, atol=1e-12)
    (out.sum() + penalty).backward()
    (expected_out.sum() + expected_penalty).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("whole, first, second, kept", [
    (2.0, 1.0, 3.0, ["samples"]),  # equal halves: their mean
    (1.5, 1.0, 3.0, ["tokens"]),  # the first half counted three times the second's entries
    (4.0, 1.0, 3.0, ["sum"]),
    (3.0, math.nan, 3.0, ["shifted"]),  # the first half counted nothing: nan, adding nothing
    (math.nan, 1.0, 3.0, ["shifted", "tokens", "samples", "sum"]),  # tells nothing
    (9.0, 1.0, 3.0, []),
])
def test_decide_keeps_the_rules_whose_join_of_the_halves_gives_the_whole(whole, first, second,
                                                                          kept):
    weights = {"shifted": [0, 4], "tokens": [3, 1], "samples": [2, 2], "sum": [2, 2]}
    assert decide(list(weights), weights, whole, first, second, 1e-4) == kept


def test_the_rule_is_found_when_the_examples_first_label_column_is_all_ignored():
    """A prompt masked in the example (column 0 all -100) still tells a token mean from a
    shifted one: the probes count entries of their own."""
    example = torch.randint(0, VOCAB, (4, 6))
    labels = example.clone()
    labels[:, 0] = -100
    pipe = fxpipe.compile(TokenModel("tokens"), fxpipe.Plan(stages=2, micro_batches=2,
                                                            costs="none"),
                          example_inputs=(example,), example_kwargs={"labels": labels})
    assert "a mean over the entries of labels other than -100\n" in repr(pipe) + "\n"


class Targets(nn.Module):
    """Labels given as `targets=`, and a masked token mean written out by hand (a micro-batch
    with nothing counted divides 0 by 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)

    def forward(self, idx, targets):
        logits = self.head(self.embed(idx))
        counted = targets != -100
        losses = F.cross_entropy(logits.flatten(0, 1), targets.clamp(min=0).flatten(),
                                 reduction="none").view_as(targets)
        return (losses * counted).sum() / counted.sum(), logits


def test_targets_are_labels_too_and_a_micro_batch_counting_nothing_adds_no_gradient():
    model = Targets().double()
    reference = copy.deepcopy(model)
    idx = torch.randint(0, VOCAB, (8, 5))
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2, costs="none"),
                          example_inputs=(idx, idx))
    assert "a mean over the entries of targets other than -100" in repr(pipe)
    targets = idx.clone()
    targets[:4] = -100  # the first micro-batch counts nothing
    pipe(idx, targets)[0].backward()
    reference(idx, targets)[0].backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


class OneHot(nn.Module):
    """A per-sample mean over labels that cannot be -100 (one_hot refuses them)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(3, 3), nn.Linear(3, VOCAB)

    def forward(self, x, labels):
        logits = self.head(self.body(x))
        return -(F.one_hot(labels, VOCAB) * logits.log_softmax(-1)).sum(-1).mean(), logits


def test_a_loss_whose_labels_cannot_be_ignored_is_a_mean_over_samples():
    x, labels = torch.randn(6, 3), torch.randint(0, VOCAB, (6,))
    pipe = fxpipe.compile(OneHot(), fxpipe.Plan(stages=2, micro_batches=3, costs="none"),
                          example_inputs=(x,), example_kwargs={"labels": labels})
    assert "joins over micro-batches as a mean over samples" in repr(pipe)
