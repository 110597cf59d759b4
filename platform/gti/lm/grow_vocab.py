"""Growing an already extended vocabulary: SID tokens appended to a model that has SID rows.

What it is for: `gti refresh` with `refresh.on_full_group: add_tokens` adds codes to the last SID
level (`gti.sid.map_edits.add_last_level_codes`); their tokens must reach the model the refresh
continues from. `append_tokens(model, tokenizer, new_tokens, like_ids)` adds them at the end of
the tokenizer and gives the model a row for each, the mean of its level's rows (`level_mean`);
a grounding pass then trains them with the other SID rows.

What it does NOT know: which codes were added or why (the caller passes the token strings and
the ids of their level's existing tokens), training, files, Ray.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from gti.lm import new_rows


def level_mean(weight: Tensor, like_ids: Sequence[int]) -> Tensor:
    """float32 [d]: the mean of the rows `like_ids` of `weight` [V, d]."""
    ids = torch.as_tensor(list(like_ids), dtype=torch.long)
    if ids.numel() == 0:
        raise new_rows.VocabError("no existing rows of the level to take the mean of")
    if int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]:
        raise new_rows.VocabError(
            f"level row ids {int(ids.min())}..{int(ids.max())} outside the {weight.shape[0]} rows")
    return weight.detach().to(torch.float32)[ids].mean(dim=0)


def append_tokens(model, tokenizer, new_tokens: Sequence[str], like_ids: Sequence[int]) -> tuple[int, int]:
    """Append `new_tokens` to `tokenizer` and `model` (in place); return their ids `[first, end)`.

    like_ids: tokenizer ids of the existing tokens of the level the new ones belong to; each
    new row (input, and untied head) is their mean (`level_mean` of that matrix): where mean
    initialisation would put a token of that level.
    The tokens get contiguous ids, one token each (`gti.lm.new_rows.extend_tokenizer`), and the
    rows are built with `gti.lm.new_rows`' surgery (attach the rows, merge them back): every old
    row stays bit-identical, a matrix padded past its tokenizer (Qwen3) gets the rows on its
    padding, a tied head keeps sharing one matrix.
    The model must be a plain HF model (no split modules attached); afterwards it is one
    again, with `config.vocab_size` covering the new ids. VocabError when a token is in the
    tokenizer already.
    """
    toks = list(new_tokens)
    present = [t for t in toks if t in tokenizer.get_vocab()]
    if present:
        raise new_rows.VocabError(f"token '{present[0]}' is in the tokenizer already")
    tied = new_rows.heads_tied(model) or (model.get_output_embeddings() is not None
                                          and bool(getattr(model.config, "tie_word_embeddings", False)))
    mean_in = level_mean(new_rows.old_rows(model, which="input"), like_ids)
    mean_out = None
    if model.get_output_embeddings() is not None and not tied:
        mean_out = level_mean(new_rows.old_rows(model, which="output"), like_ids)
    first, end = new_rows.extend_tokenizer(tokenizer, toks)
    n = end - first
    init_in = mean_in.unsqueeze(0).expand(n, -1).clone()
    init_out = None if mean_out is None else mean_out.unsqueeze(0).expand(n, -1).clone()
    new_rows.attach_new_rows(model, first, n, init_in, init_out)
    new_rows.merge_new_rows(model)
    return first, end
