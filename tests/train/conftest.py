"""Fixtures for tests/train: a synthetic grounding problem (tiny model, 2-level SIDs, one
name->SID pair per item) written as the files the grounding loop reads, without running the
upstream stages.

The prompt is deliberately short ("<name>:") and the head untied: a tiny RANDOM backbone only
passes item information to the second SID position through near-uniform attention, so long
chat prompts dilute it below what 40 steps can learn (measured: exact match stays at chance
with chat prompts, ~0.3 with these settings). Real models (the stage and the benchmark) use
the chat templates."""

from __future__ import annotations

from pathlib import Path

import pytest

WORDS = (
    "glass beaker flask tube pipette steel plastic bottle gloves tape label battery cable "
    "sensor meter drill blade clamp magnet filter pump valve hose brass copper rubber foam"
).split()


def make_grounding_problem(root: Path, n_items: int = 24, sizes=(6, 6), seed: int = 0) -> dict:
    """Write init rows, pairs (train = every item's title->SID pair; val = the same pairs, so
    exact match measures what grounding learned), val prompts and catalog SIDs under `root`.

    Returns the pieces a test needs to build the worker config (`WorkerConfig.build`).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import save_file

    from gti.config import ModelConfig
    from gti.lm import init as lm_init
    from gti.lm import models, new_rows
    from gti.sid.codec import SidCodec
    from gti.train.worker_config import GroundRows, ValSet

    root.mkdir(parents=True, exist_ok=True)
    mcfg = ModelConfig(name="tiny", tiny_hidden=64, tiny_layers=2, tiny_heads=2, tiny_tied=False)
    model, tok = models.build_tiny(mcfg, seed=seed)
    n_before = len(tok)
    codec = SidCodec(len(sizes), list(sizes))
    first, end = new_rows.extend_tokenizer(tok, codec.tokens())
    codes = [(i % sizes[0], (i // sizes[0]) % sizes[1]) for i in range(n_items)]
    assert len(set(codes)) == n_items
    sid_ids = codec.token_ids_from_offset(torch.tensor(codes), first)  # [N, L]
    rows = {k: [] for k in ("item_id", "task", "split", "input_ids", "labels", "prompt_ids", "answer_ids")}
    val_prompt, val_target = [], []
    for i in range(n_items):
        prompt = tok.encode(f"{WORDS[i]}:")
        answer = sid_ids[i].tolist()
        for split in ("train", "val"):
            rows["item_id"].append(str(i))
            rows["task"].append("title2sid")
            rows["split"].append(split)
            rows["input_ids"].append(prompt + answer)
            rows["labels"].append([-100] * len(prompt) + answer)
            rows["prompt_ids"].append(prompt)
            rows["answer_ids"].append(answer)
        val_prompt.append(prompt)
        val_target.append(sid_ids[i].tolist())
    pq.write_table(pa.table(rows), root / "pairs.parquet")
    pq.write_table(pa.table({"prompt": val_prompt, "target": val_target}), root / "val.parquet")
    save_file({"sid_token_ids": sid_ids.contiguous()}, str(root / "sids.safetensors"))
    old = new_rows.old_rows(model, n_before)
    init = lm_init.init_rows("mean_noise", old, end - first, noise_std=0.5,
                             generator=torch.Generator().manual_seed(seed))
    head = lm_init.init_rows("mean_noise", new_rows.old_rows(model, n_before, which="output"), end - first,
                             noise_std=0.5, generator=torch.Generator().manual_seed(seed + 1))
    save_file({"e_new": init.contiguous(), "head_new": head.contiguous()}, str(root / "init.safetensors"))
    return {
        "model_cfg": mcfg,
        "pairs": root / "pairs.parquet",
        "pad_id": tok.pad_token_id,
        "first": first,
        "end": end,
        "n_items": n_items,
        "ground": GroundRows(str(root / "init.safetensors"), first, end - first),
        "val": ValSet(str(root / "val.parquet"), str(root / "sids.safetensors"), first, end, len(sizes)),
    }


@pytest.fixture(scope="module")
def grounding_problem(tmp_path_factory):
    return make_grounding_problem(tmp_path_factory.mktemp("ground_problem"))
