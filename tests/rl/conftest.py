"""Fixtures for tests/rl: a tiny random Llama whose vocabulary has a SID slice, a random SID
catalog and prompts (handed out by the `rl` fixture: test modules cannot import a conftest
under --import-mode=importlib). No downloads."""

from __future__ import annotations

import pytest
import torch

VOCAB, FIRST_NEW, LEVELS, CODEBOOK = 100, 64, 3, 8  # SID tokens 64..87 (level l, code c: 64 + 8l + c)
NEW_END = FIRST_NEW + LEVELS * CODEBOOK


def random_sids(n_items: int, seed: int = 0) -> torch.Tensor:
    """n distinct SIDs as token ids [N, L]."""
    g = torch.Generator().manual_seed(seed)
    seen, rows = set(), []
    while len(rows) < n_items:
        codes = tuple(torch.randint(0, CODEBOOK, (LEVELS,), generator=g).tolist())
        if codes not in seen:
            seen.add(codes)
            rows.append([FIRST_NEW + lv * CODEBOOK + c for lv, c in enumerate(codes)])
    return torch.tensor(rows, dtype=torch.long)


def tiny_llama(seed: int = 0, head_std: float | None = 1.0):
    """Random LlamaForCausalLM (vocab 100, untied head), in eval mode. head_std: std of the head
    and embedding rows (1.0: logits spread out, no near-ties, a peaked policy; None: the default
    small init, a near-uniform policy that RL can move)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    if head_std is not None:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, head_std)
            model.model.embed_tokens.weight.normal_(0.0, head_std)
    return model


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    """n prompts of different lengths over ordinary tokens 3..63."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, FIRST_NEW, (4 + (3 * i) % 7,), generator=g).tolist() for i in range(n)]


def trie(sids: torch.Tensor):
    from gti.sid.trie import SidTrie

    return SidTrie(sids, FIRST_NEW, NEW_END)


class RlSpace:
    VOCAB, FIRST_NEW, LEVELS, CODEBOOK, NEW_END = VOCAB, FIRST_NEW, LEVELS, CODEBOOK, NEW_END
    random_sids = staticmethod(random_sids)
    tiny_llama = staticmethod(tiny_llama)
    prompts = staticmethod(prompts)
    trie = staticmethod(trie)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The tensors are tiny: on a shared 2-core machine extra intra-op threads only contend
    (as in tests/sid/conftest.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def rl():
    return RlSpace
