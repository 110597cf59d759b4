"""Fixtures for tests/eval: a tiny random Llama with a SID vocabulary slice, a brute-force
dict trie with the `gti.sid.trie.SidTrie` interface, and random SID catalogs."""

from __future__ import annotations

import pytest
import torch


class DictTrie:
    """Brute-force reference with the SidTrie interface (python dicts, loops per row)."""

    def __init__(self, sid_token_ids: torch.Tensor, vocab_new_start: int, vocab_new_end: int):
        self.sid_token_ids = sid_token_ids.long()
        self.vocab_new_start, self.vocab_new_end = vocab_new_start, vocab_new_end
        self.levels = sid_token_ids.shape[1]
        self.index = {tuple(r): i for i, r in enumerate(self.sid_token_ids.tolist())}
        self.next: dict[tuple, set] = {}
        for row in self.sid_token_ids.tolist():
            for t in range(self.levels):
                self.next.setdefault(tuple(row[:t]), set()).add(row[t])

    def allowed(self, prefixes: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(prefixes.shape[0], self.vocab_new_end - self.vocab_new_start, dtype=torch.bool)
        for b, row in enumerate(prefixes.tolist()):
            for tok in self.next.get(tuple(row), ()):
                out[b, tok - self.vocab_new_start] = True
        return out

    def item_index(self, sid_ids: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self.index.get(tuple(r), -1) for r in sid_ids.tolist()], dtype=torch.long)


def random_sids(n_items: int, levels: int, codebook: int, first_new: int, seed: int = 0) -> torch.Tensor:
    """n distinct SIDs as token ids: level l code c -> first_new + l*codebook + c. [N, L]"""
    g = torch.Generator().manual_seed(seed)
    seen, rows = set(), []
    while len(rows) < n_items:
        codes = torch.randint(0, codebook, (levels,), generator=g).tolist()
        if tuple(codes) not in seen:
            seen.add(tuple(codes))
            rows.append([first_new + lv * codebook + c for lv, c in enumerate(codes)])
    return torch.tensor(rows, dtype=torch.long)


VOCAB, FIRST_NEW, LEVELS, CODEBOOK = 100, 64, 3, 8  # new tokens 64..87; 88..99 old again
NEW_END = FIRST_NEW + LEVELS * CODEBOOK


def tiny_llama(seed: int = 0, sid_row_scale: float = 1.0):
    """Random LlamaForCausalLM, vocab 100, untied head with std-1 rows so logits are spread out
    (no near-ties). `sid_row_scale` scales the head rows of the SID tokens (small = the model
    prefers ordinary tokens, which makes unconstrained search emit invalid SIDs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)
        model.lm_head.weight[FIRST_NEW:NEW_END] *= sid_row_scale
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    return model




def prompts(n: int, seed: int = 1) -> list[list[int]]:
    """n prompts of different lengths over ordinary tokens 3..63."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, FIRST_NEW, (4 + (3 * i) % 7,), generator=g).tolist() for i in range(n)]


class SidSpace:
    """Everything the decode tests need, handed out by the `sidspace` fixture (test modules
    cannot import this conftest under --import-mode=importlib)."""

    VOCAB, FIRST_NEW, LEVELS, CODEBOOK, NEW_END = VOCAB, FIRST_NEW, LEVELS, CODEBOOK, NEW_END
    DictTrie = DictTrie
    random_sids = staticmethod(random_sids)
    tiny_llama = staticmethod(tiny_llama)
    prompts = staticmethod(prompts)


@pytest.fixture
def sidspace():
    return SidSpace
