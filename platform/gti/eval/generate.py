"""transformers `generate` for SIDs: the neutral generation config, and the peer method.

What it is for: `override_generation_config(model)` replaces a checkpoint's generation_config by
a neutral beam-search one; exported models carry it, so `generate` on them scores beams as our
search does. `generate_with_prefix_fn` is the peer method: `generate` +
`prefix_allowed_tokens_fn` over the catalog trie, as LC-Rec and MiniOneRec do, kept as the
reference our search is compared with in tests and bench/decode/decode.py.

What it does NOT know: our batched KV-cache search (`gti.eval.decode`), how prompts are
rendered (`gti.lm.templates`), how the trie is built (`gti.sid.trie`), metrics, or Ray.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from gti.eval.beams import DecodeResult, TrieLike, as_prompt_lists, chunks, finalise, left_pad, model_device


# --------------------------------------------------------------------------- generation config
def override_generation_config(
    model: Any,
    *,
    beam_width: int | None = None,
    k: int | None = None,
    levels: int | None = None,
    pad_id: int | None = None,
) -> GenerationConfig:
    """Replace `model.generation_config` by a neutral beam-search config and return it.

    Instruct checkpoints ship sampling settings (do_sample, temperature, top_k, top_p,
    repetition_penalty, ...). transformers fills every field a caller leaves as None from
    `model.generation_config`, so passing a fresh `GenerationConfig(num_beams=...)` to `generate`
    still inherits them, and a top_k/top_p warper or a penalty silently cuts or reorders valid
    beams. So the model's config itself is replaced by one built from scratch, with every
    scoring-relevant field set explicitly to its neutral value; only token ids are kept.

    `length_penalty=0`: all SIDs have the same length L, so it changes only the scale of the
    reported `sequences_scores`, which then equal the sums of log-probs our search reports.
    """
    old = getattr(model, "generation_config", None)
    keep = {}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        val = getattr(old, name, None) if old is not None else None
        if val is not None:
            keep[name] = val
    if pad_id is not None:
        keep["pad_token_id"] = pad_id
    neutral: dict[str, Any] = dict(
        do_sample=False,
        temperature=1.0,
        # None, not 0: with do_sample=False no warper runs, and transformers warns about a
        # non-default top_k; the checkpoint's value cannot leak back because the model's
        # config is replaced below (None falls through to the global default, inert here).
        top_k=None,
        top_p=1.0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        length_penalty=0.0,
        early_stopping=False,
        min_length=0,
        use_cache=True,
        num_beam_groups=1,
        diversity_penalty=0.0,
        renormalize_logits=False,
        remove_invalid_values=False,
    )
    if beam_width is not None:
        neutral["num_beams"] = beam_width
    if k is not None:
        neutral["num_return_sequences"] = k
    if levels is not None:
        neutral["max_new_tokens"] = levels
    cfg = GenerationConfig(**keep)
    for name, val in neutral.items():
        # Set one by one: some fields (num_beam_groups, diversity_penalty) may not exist in every
        # transformers release, and an unknown one must not stop the others.
        setattr(cfg, name, val)
    model.generation_config = cfg
    return cfg


# --------------------------------------------------------------------------- the peer method
def make_prefix_allowed_tokens_fn(
    trie: TrieLike, prompt_len: int
) -> Callable[[int, torch.Tensor], list[int]]:
    """`prefix_allowed_tokens_fn` for `generate`: allowed next tokens after the SID tokens that
    follow the (left-padded, hence common) prompt length. Called once per beam per step, the way
    LC-Rec / MiniOneRec use it."""

    def fn(batch_id: int, input_ids: torch.Tensor) -> list[int]:
        prefix = input_ids[prompt_len:].unsqueeze(0).cpu()
        allowed = trie.allowed(prefix)[0]
        return (allowed.nonzero().squeeze(-1) + trie.vocab_new_start).tolist()

    return fn


@torch.inference_mode()
def generate_with_prefix_fn(
    model: Any,
    prompt_ids: Sequence[Sequence[int]] | torch.Tensor,
    trie: TrieLike,
    *,
    beam_width: int,
    k: int,
    levels: int,
    pad_id: int,
    constrained: bool = True,
    batch_users: int = 8,
    generation_config: GenerationConfig | None = None,
) -> DecodeResult:
    """The peer: transformers `generate` (beam search, num_return_sequences=k) with
    `prefix_allowed_tokens_fn` over the same trie. `generation_config` defaults to
    `override_generation_config(model, ...)`; pass the model's own config to see the trap.
    Returns a DecodeResult comparable with `constrained_beam_search` (beam_* hold the K
    returned sequences)."""
    if generation_config is None:
        generation_config = override_generation_config(
            model, beam_width=beam_width, k=k, levels=levels, pad_id=pad_id
        )
    run_cfg = copy.deepcopy(generation_config)
    # sequences_scores needs both (LC-Rec asks for them the same way).
    run_cfg.return_dict_in_generate = True
    run_cfg.output_scores = True
    prompts = as_prompt_lists(prompt_ids)
    device = model_device(model)
    parts = []
    for sl in chunks(len(prompts), max(1, batch_users)):
        t0 = time.perf_counter()
        ids, mask, _ = left_pad(prompts[sl], pad_id, device)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=run_cfg,
            prefix_allowed_tokens_fn=make_prefix_allowed_tokens_fn(trie, ids.shape[1]) if constrained else None,
        )
        n = ids.shape[0]
        gen = out.sequences[:, ids.shape[1] :]
        if gen.shape[1] < levels:  # finished early on EOS (only possible unconstrained)
            gen = F.pad(gen, (0, levels - gen.shape[1]), value=pad_id)
        gen = gen[:, :levels].reshape(n, k, levels)
        scores = out.sequences_scores.float().reshape(n, k)
        parts.append(finalise(gen, scores, trie, k, {"total_s": time.perf_counter() - t0}))
    return DecodeResult.concat(parts)
