"""The transformers `generate` side (gti/eval/generate.py) on a tiny random Llama: the peer
method (`generate` + `prefix_allowed_tokens_fn`) agrees with our constrained beam search, and
the generation-config override removes a checkpoint's sampling settings."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from gti.eval.beams import topk_agreement
from gti.eval.decode import constrained_beam_search
from gti.eval.generate import generate_with_prefix_fn, make_prefix_allowed_tokens_fn, override_generation_config
from gti.sid.trie import SidTrie


def _search(model, prompts, trie, s, **kw):
    args = dict(beam_width=8, k=5, levels=s.LEVELS, pad_id=0)
    args.update(kw)
    return constrained_beam_search(model, prompts, trie, **args)


def test_prefix_fn_allows_only_the_catalog_continuations(sidspace):
    s = sidspace
    sids = torch.tensor([[s.FIRST_NEW, s.FIRST_NEW + 8], [s.FIRST_NEW, s.FIRST_NEW + 9],
                         [s.FIRST_NEW + 1, s.FIRST_NEW + 8]])
    fn = make_prefix_allowed_tokens_fn(SidTrie(sids, s.FIRST_NEW, s.NEW_END), prompt_len=2)
    prompt = [5, 6]
    assert sorted(fn(0, torch.tensor(prompt))) == [s.FIRST_NEW, s.FIRST_NEW + 1]
    assert sorted(fn(0, torch.tensor(prompt + [s.FIRST_NEW]))) == [s.FIRST_NEW + 8, s.FIRST_NEW + 9]
    assert fn(0, torch.tensor(prompt + [s.FIRST_NEW + 1])) == [s.FIRST_NEW + 8]


def test_override_keeps_token_ids_and_sets_the_search_shape():
    class Model:
        generation_config = GenerationConfig(do_sample=True, top_k=3, bos_token_id=1, eos_token_id=2)

    model = Model()
    cfg = override_generation_config(model, beam_width=6, k=4, levels=3, pad_id=0)
    assert model.generation_config is cfg
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)
    assert (cfg.num_beams, cfg.num_return_sequences, cfg.max_new_tokens) == (6, 4, 3)
    assert cfg.do_sample is False and cfg.top_k is None and cfg.length_penalty == 0.0


def test_matches_transformers_generate_with_prefix_fn(sidspace):
    s = sidspace
    sids = s.random_sids(50, s.LEVELS, s.CODEBOOK, s.FIRST_NEW, seed=9)
    trie = SidTrie(sids, s.FIRST_NEW, s.NEW_END)
    model = s.tiny_llama(seed=5)
    users = s.prompts(4, seed=3)
    ours = _search(model, users, trie, s, batch_users=2)
    peer = generate_with_prefix_fn(
        model, users, trie, beam_width=8, k=5, levels=s.LEVELS, pad_id=0, batch_users=4
    )
    assert peer.n_invalid == 0
    agree = topk_agreement(ours, peer, atol=1e-4)
    assert agree["exact_users"] == 4, agree
    assert agree["max_score_diff"] < 1e-4


def test_generation_config_override(sidspace):
    """A checkpoint whose generation_config samples with top_k=5 / top_p=0.5 must not change
    our search nor the peer path once overridden."""
    s = sidspace
    sids = s.random_sids(50, s.LEVELS, s.CODEBOOK, s.FIRST_NEW, seed=9)
    trie = SidTrie(sids, s.FIRST_NEW, s.NEW_END)
    users = s.prompts(3, seed=3)
    clean = s.tiny_llama(seed=5)
    reference = _search(clean, users, trie, s)

    model = s.tiny_llama(seed=5)
    sampling = GenerationConfig(
        do_sample=True, top_k=5, top_p=0.5, temperature=0.7, repetition_penalty=1.3,
        no_repeat_ngram_size=2, pad_token_id=0, eos_token_id=2,
    )
    model.generation_config = sampling
    # The trap exists in this transformers: a fresh config passed to generate inherits the
    # checkpoint's sampling settings for every field it leaves unset.
    naive, _ = model._prepare_generation_config(GenerationConfig(num_beams=8, max_new_tokens=3))
    assert naive.do_sample is True and naive.top_k == 5 and naive.top_p == 0.5

    ours = _search(model, users, trie, s)
    assert torch.equal(ours.items, reference.items)
    torch.testing.assert_close(ours.scores, reference.scores)

    cfg = override_generation_config(model, beam_width=8, k=5, levels=s.LEVELS, pad_id=0)
    assert model.generation_config is cfg
    resolved, _ = model._prepare_generation_config(cfg)
    assert resolved.do_sample is False and resolved.top_k != 5 and resolved.top_p == 1.0
    assert resolved.temperature == 1.0 and resolved.repetition_penalty == 1.0
    assert resolved.no_repeat_ngram_size == 0 and resolved.num_beams == 8
    assert resolved.eos_token_id == 2 and resolved.pad_token_id == 0, "token ids are kept"

    # The peer path, on the sampling checkpoint (it overrides again internally), agrees with
    # our search on the clean model, twice in a row (no sampling left).
    model.generation_config = sampling
    for _ in range(2):
        peer = generate_with_prefix_fn(model, users, trie, beam_width=8, k=5, levels=s.LEVELS, pad_id=0)
        agree = topk_agreement(reference, peer, atol=1e-4)
        assert agree["exact_users"] == 3, agree
