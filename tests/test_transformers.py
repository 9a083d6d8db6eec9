"""HuggingFace transformers models (built from a config, random weights, no download)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import fxpipe

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _gpt2():
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
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
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-8, atol=1e-12, msg=name)



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
