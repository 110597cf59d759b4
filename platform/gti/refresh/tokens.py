"""Step 4 of `gti refresh`: the code tokens the new map added, appended to the parent's model.

What it is for: with `refresh.on_full_group: add_tokens` the assign step may grow the last SID
level; `tokens_step(job)` then writes `<work>/grown_model/`, the parent's model and tokenizer
with one token per added code, which every later step starts from (`Job.base_model_dir`).
Without added codes it does nothing. Why tokens are added: docs/refresh.md#full-prefix-groups.

What it does not know: how the codes were assigned (it reads the version records), training,
Ray.
"""

from __future__ import annotations

from gti.refresh.attempt import GROWN_MODEL, Job


def added_codes(job: Job) -> list[tuple[int, int]]:
    """(level, code) of the codes the new map has beyond the parent's map."""
    from gti.sid.codec import codes_added

    return codes_added(job.parent.codebook_sizes, job.map_facts()["codebook_sizes"])


def tokens_step(job: Job) -> dict:
    """Step 4, when the assign step grew the last level (the new map's version record has larger
    codebook sizes than the parent's map): `<work>/grown_model/`, the parent's model and tokenizer
    with one token per added code appended (`gti.lm.grow_vocab.append_tokens`: old rows
    bit-identical; each added row, input and untied head, starts as the mean of the existing rows
    of the last level, where mean initialisation would put it; the grounding pass then trains it
    with the other SID rows). Its `gti_meta.json` is the parent's plus `new_token_ids` [first,
    end) covering the added tokens (the rows grounding trains, `Job.token_range`),
    `added_token_ids`, `added_tokens` and `codebook_sizes`. With `refresh.ground_steps: 0` it is
    the exported model as it is (the added rows untrained, at their level's mean). The model is
    loaded in this process, on the CPU, like the embed step's encoder."""
    from gti.lm import grow_vocab, models, new_rows
    from gti.sid.codec import SidCodec, level_letter

    added = added_codes(job)
    if not added:
        return {"added_tokens": 0}
    if job.base_model_dir != job.parent.model_dir:  # a grown model from an interrupted attempt
        import shutil

        shutil.rmtree(job.work / GROWN_MODEL)
    first, end_before = job.token_range()
    facts = job.map_facts()
    old = SidCodec(int(facts["levels"]), list(job.parent.codebook_sizes), facts["token_format"])
    new = SidCodec.from_facts(facts)
    tokens = [new.token(lv, c) for lv, c in added]
    last = old.levels - 1
    model, tok = models.load_model_and_tokenizer(job.cfg.model, path=job.parent.model_dir)
    like = tok.convert_tokens_to_ids([old.token(last, c) for c in range(old.codebook_sizes[last])])
    a, b = grow_vocab.append_tokens(model, tok, tokens, like)
    meta = dict(new_rows.read_meta(job.parent.model_dir))
    meta.update({"new_token_ids": [first, b], "added_token_ids": [a, b], "added_tokens": tokens,
                 "codebook_sizes": list(new.codebook_sizes)})
    new_rows.export_model(model, tok, job.work / GROWN_MODEL, meta)
    job.log(f"tokens: {len(tokens)} code token(s) appended at ids [{a}, {b}) ({tokens[0]} .. {tokens[-1]}), "
            f"rows at the mean of level {level_letter(last)}'s; SID rows now [{first}, {b}) "
            f"(were [{first}, {end_before}))")
    return {"added_tokens": len(tokens), "tokens": tokens, "added_token_ids": [a, b], "new_token_ids": [first, b],
            "codebook_sizes": list(new.codebook_sizes)}
