"""HuggingFace transformers models (built from a config, random weights, no download)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fxpipe

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install -e '.[test]' has it")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _gpt2(**config):
    dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # outputs comparable
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32, bos_token_id=0,
        eos_token_id=0, **{**dropout, **config},  # use_cache at the config's default: on
    )
    return transformers.GPT2LMHeadModel(config)


def _bert():
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("build", [_gpt2, _bert], ids=["gpt2", "bert"])
def test_hf_model_compiles_through_export_and_matches(build, stages):
    model = build().double()
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 128, (4, 12))
    plan = fxpipe.Plan(stages=stages, micro_batches=2, costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(idx,))
    assert pipe.frontend == "export"  # transformers 5 models do not fx-trace; auto falls back
    assert pipe.shared_parameters()  # tied input/output embeddings
    out, expected = pipe(idx), reference(idx)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-10, atol=1e-12)
    out.logits.square().mean().backward()
    expected.logits.square().mean().backward()
    _same_gradients(pipe, reference)


def _same_gradients(pipe, reference):
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-8, atol=1e-12, msg=name)


def test_gpt2_with_its_default_config_compiles_with_the_cache_off_while_tracing():
    model = _gpt2().double()
    assert model.config.use_cache  # its default: forward returns a DynamicCache
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, costs="none"),
                          example_inputs=(torch.randint(0, 128, (4, 12)),))
    assert model.config.use_cache  # as the user left it
    idx = torch.randint(0, 128, (4, 12))
    torch.testing.assert_close(pipe(idx).logits, model(idx).logits, rtol=1e-10, atol=1e-12)


def test_a_cache_asked_for_in_the_call_is_refused_with_use_cache_false_as_the_fix():
    idx = torch.randint(0, 128, (4, 12))
    with pytest.raises(fxpipe.FxpipeTraceError, match=r"(?s)DynamicCache.*call it with "
                                                      r"use_cache=False"):
        fxpipe.compile(_gpt2(), fxpipe.Plan(stages=2, costs="none"), example_inputs=(idx,),
                       example_kwargs={"use_cache": True})


def test_labels_give_the_plain_models_loss_and_gradients_in_one_micro_batch():
    model = _gpt2().double()
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 128, (4, 12))  # passed as input_ids and as labels: one tensor twice
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=1, costs="none"),
                          example_kwargs={"input_ids": idx, "labels": idx})
    ours, theirs = pipe(idx, labels=idx), reference(idx, labels=idx)  # positional input_ids
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-10, atol=1e-12)
    ours.loss.backward()
    theirs.loss.backward()
    _same_gradients(pipe, reference)


@pytest.mark.parametrize("call, message", [
    ({}, r"this call gives forward\(\) argument 'labels' None \(its default\), but the "
         r"pipeline's graph holds it at a tensor: torch.export fixed it .*example_kwargs="),
    ({"labels": 0, "attention_mask": 0}, r"gives forward\(\) argument 'attention_mask' a "
                                         r"tensor, but the pipeline's graph holds it at None"),
])
def test_a_call_unlike_the_exported_example_is_refused_by_argument(call, message):
    idx = torch.randint(0, 128, (4, 12))
    pipe = fxpipe.compile(_gpt2(), fxpipe.Plan(stages=2, micro_batches=1, costs="none"),
                          example_inputs=(idx,), example_kwargs={"labels": idx})
    with pytest.raises(fxpipe.FxpipeError, match=message):
        pipe(idx, **{name: torch.ones_like(idx) for name in call})


@settings(max_examples=4)
@given(build=st.sampled_from([_gpt2, _bert]), micro_batches=st.integers(2, 3),
       padded=st.lists(st.integers(0, 12), min_size=6, max_size=6))
def test_labels_split_into_micro_batches_give_the_plain_models_loss_and_gradients(
        build, micro_batches, padded):
    model = build().double()
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 128, (6, 12))
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=micro_batches,
                                             costs="none"),
                          example_inputs=(idx,), example_kwargs={"labels": idx})
    how = "a mean over the entries of labels other than -100"
    assert f"model output #0 (one number) joins over micro-batches as {how}" in repr(pipe)
    labels = idx.clone()
    for row, start in enumerate(padded):  # each row's tail is padding, ignored by the loss
        labels[row, start:] = -100
    labels[0, 5] = 7  # one counted token at least: the plain model's loss is a number
    ours, theirs = pipe(idx, labels=labels), reference(idx, labels=labels)
    # HuggingFace computes the loss in float32 (logits.float()): its rounding, not ours
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=1e-7)
    ours.loss.backward()
    theirs.loss.backward()
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_sequence_classifiers_labels_give_the_plain_models_loss_over_micro_batches():
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    model = transformers.BertForSequenceClassification(config).double()
    reference = copy.deepcopy(model)
    idx, labels = torch.randint(0, 128, (6, 12)), torch.randint(0, 3, (6,))
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=3, costs="none"),
                          example_inputs=(idx,), example_kwargs={"labels": labels})
    ours, theirs = pipe(idx, labels=labels), reference(idx, labels=labels)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-10, atol=1e-12)
    ours.loss.backward()
    theirs.loss.backward()
    _same_gradients(pipe, reference)


def test_eval_on_an_exported_model_runs_the_model_traced_in_eval_mode():
    model = _gpt2(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1).double()  # the defaults
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 128, (4, 12))
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, costs="none"), example_inputs=(idx,))
    assert pipe.frontend == "export" and pipe.training
    pipe.eval()
    reference.eval()
    torch.testing.assert_close(pipe(idx).logits, reference(idx).logits, rtol=1e-10,
                               atol=1e-12)
    pipe(idx).logits.square().mean().backward()  # the same parameters, in either mode
    reference(idx).logits.square().mean().backward()
    _same_gradients(pipe, reference)
    pipe.train()  # back to the graph traced in training mode: dropout
    assert not torch.equal(pipe(idx).logits, pipe(idx).logits)



def test_hf_gpt2_trains_like_the_plain_model():
    model = _gpt2().double()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 128, (4, 12), generator=gen) for _ in range(3)]

    def loss_fn(out, target):
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    plan = fxpipe.Plan(stages=2, micro_batches=2, schedule="1f1b", loss_fn=loss_fn,
                       costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(batches[0],))
    ours = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for idx in batches:
        ours.zero_grad()
        pipe.step(idx, idx)
        ours.step()
        theirs.zero_grad()
        loss_fn(reference(idx), idx).backward()
        theirs.step()
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11, msg=name)
