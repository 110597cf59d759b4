"""Steps 2, 3 and 5 of `gti refresh`: the new items' embeddings, SIDs and grounding pairs.

What it is for: `embed_step(job)` (the run's encoder on the new items, in this process),
`assign_step(job)` (the run's frozen quantiser and `gti.sid.map_edits.assign_new_items`: a new
SID-map version that never changes an existing SID; full prefix groups as
`refresh.on_full_group` says, docs/refresh.md#full-prefix-groups) and `pairs_step(job)` (the
new items' grounding pairs with the pairs stage's renderer, plus a replay sample of old
pairs), each writing into the work folder.

What it does not know: training, the model's weights, Ray.
"""

from __future__ import annotations

from gti.common.errors import DataError
from gti.common.files import atomic_write_json
from gti.run.manifest import Manifest
from gti.refresh.attempt import NEEDS_NEW_TOKENS, Job, RefreshError


def embed_step(job: Job) -> dict:
    """Step 2: the run's encoder (`embed` section, `gti.embed.encoders`) on the new items, in this
    process -> `<work>/embed/embeddings.parquet` (RefreshError when its dim is not the run's)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gti.embed.encoders import build_encoder, item_text

    e = job.cfg.embed
    items = pq.read_table(str(job.work / "ingest" / "items.parquet")).to_pydict()
    enc = build_encoder(e, job.cfg.model, device="cuda" if e.num_gpus > 0 else "cpu", seed=job.cfg.seed)
    texts = [item_text(t or "", d or "", c or "", a or "", e.fields) for t, d, c, a in
             zip(items["title"], items["description"], items["category"], items["attributes_text"])]
    vecs = np.concatenate([enc.encode(texts[i: i + e.batch_size]) for i in range(0, len(texts), e.batch_size)])
    vecs = np.ascontiguousarray(vecs, dtype=np.float32)
    bad = np.nonzero(~np.isfinite(vecs).all(1))[0]
    if bad.size:
        raise DataError(f"embed.encoder {e.encoder}: non-finite embedding for new item_id {items['item_id'][bad[0]]}")
    want = Manifest.read(job.run_dir / "embed").facts.get("dim")
    if want is not None and int(want) != vecs.shape[1]:
        raise RefreshError(f"embed: the encoder gives dim {vecs.shape[1]} but the run's embeddings have {want}; "
                           "refresh with the run's embed settings")
    (job.work / "embed").mkdir(exist_ok=True)
    arr = pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1)), vecs.shape[1])
    pq.write_table(pa.table({"item_id": items["item_id"], "embedding": arr}),
                   str(job.work / "embed" / "embeddings.parquet"))
    return {"n_items": len(texts), "dim": int(vecs.shape[1]), "encoder": e.encoder}


def _quantise(job: Job):
    """(new item ids, their quantiser codes, the last level's costs or None)."""
    import pyarrow.parquet as pq
    import torch

    from gti.sid.embeddings import embedding_matrix
    from gti.sid.kmeans import sq_dists
    from gti.sid.quantizer import load_quantizer

    t = pq.read_table(str(job.work / "embed" / "embeddings.parquet"))
    ids = t.column("item_id").to_pylist()
    x = torch.from_numpy(embedding_matrix(t.column("embedding"), "embeddings").copy())
    q = load_quantizer(job.run_dir / "sid")
    with torch.inference_mode():
        pre = q.encode(x)
        last_cost = None
        if not job.sf.get("dedup_level_added", True) and int(job.sf["levels"]) == q.levels:
            last_cost = sq_dists(q.last_residual(x).float(), q.level_codebooks()[-1].float())
    return ids, pre, last_cost


def _padded_cost(last_cost, k_last: int):
    """The last quantiser level's costs [M, K_q], widened to the map's last-level size with +inf
    (codes an earlier refresh added have no codebook vector: taken only when no real one is free)."""
    import torch

    if last_cost is None or last_cost.shape[1] >= k_last:
        return last_cost
    pad = torch.full((last_cost.shape[0], k_last - last_cost.shape[1]), float("inf"), dtype=last_cost.dtype)
    return torch.cat([last_cost, pad], dim=1)


def _full_groups(job: Job, a, sizes: list[int]):
    """The items needing a new token: listed in `needs_new_tokens.json`; RefreshError (one line)
    with `refresh.on_full_group: error`, else (add_tokens, the default) the `Growth` that puts
    them on added last-level codes (`gti.sid.map_edits.add_last_level_codes`)."""
    from gti.sid.map_edits import add_last_level_codes

    path = job.work / NEEDS_NEW_TOKENS
    atomic_write_json(path, [{"item_id": n.item_id, "codes": list(n.codes), "reason": n.reason}
                             for n in a.needs_new_tokens])
    mode = job.cfg.refresh.on_full_group
    first = a.needs_new_tokens[0]
    if mode != "add_tokens":
        raise RefreshError(
            f"refresh: {len(a.needs_new_tokens)} new item(s) need a SID token the vocabulary lacks "
            f"(e.g. '{first.item_id}': {first.reason}); refresh.on_full_group={mode} "
            f"(set refresh.on_full_group=add_tokens to add the tokens); the list is in {path}")
    g = add_last_level_codes(a, sizes, job.sf["token_format"])
    job.log(f"assign: {len(g.on_new_codes)} item(s) need a new token (listed in {path}); "
            f"refresh.on_full_group=add_tokens: the last level grows from {g.old_size} to "
            f"{g.codebook_sizes[-1]} codes")
    return g


def assign_step(job: Job) -> dict:
    """Step 3: the run's frozen quantiser (`<run>/sid/quantizer.*`) gives the codes and
    `gti.sid.map_edits.assign_new_items` the SIDs, never changing an existing one ->
    `<work>/sid/sid_map.parquet` with its version record (parent hash, codebook sizes) and
    `new_items.json`. The parent map's sizes are the parent version's (an earlier refresh may have
    grown the last level). Items that would need a new token: `_full_groups` (with `add_tokens`
    the version records the grown sizes, and the tokens step, `gti.refresh.tokens`, then adds the
    tokens to the model)."""
    import pyarrow.parquet as pq

    from gti.sid import versions as V
    from gti.sid.codec import SidCodec, codes_added
    from gti.sid.map_edits import Growth, assign_new_items

    sf = job.sf
    sizes = [int(k) for k in job.parent.codebook_sizes]
    ids, pre, last_cost = _quantise(job)
    parent_map = pq.read_table(str(job.parent.map_path))
    a = assign_new_items(parent_map, ids, pre, sizes, sf["token_format"],
                         last_cost=_padded_cost(last_cost, sizes[-1]))
    job.log(f"assign: {a.summary()}")
    n_full = len(a.needs_new_tokens)
    g = _full_groups(job, a, sizes) if n_full else Growth(a, sizes, sizes[-1])
    a = g.assignment
    if not a.assigned:  # the same map again: a version that is its own parent breaks lineage
        raise RefreshError(f"nothing to refresh: all {len(a.already_present)} item(s) given are already in "
                           f"map {job.parent.hash} (a refresh adds new items; to train on new interactions "
                           f"alone, rerun SFT with `gti run --from sft`)")
    version = V.make_version(a.table, job.cb_hash, g.codebook_sizes, sf["token_format"], job.parent.hash,
                             note=f"refresh v{job.k}: +{len(a.assigned)} items"
                                  + (f", +{g.n_added} last-level codes" if g.n_added else ""))
    (job.work / "sid").mkdir(exist_ok=True)
    V.write_map(job.work / "sid" / "sid_map.parquet", a.table, version)
    atomic_write_json(job.work / "sid" / "new_items.json",
                      {"assigned": a.assigned, "already_present": a.already_present,
                       "prefix_changed": a.prefix_changed, "on_new_codes": g.on_new_codes})
    codec = SidCodec(len(g.codebook_sizes), g.codebook_sizes, sf["token_format"])
    return {"assigned": len(a.assigned), "already_present": len(a.already_present),
            "prefix_changed": len(a.prefix_changed), "needs_new_tokens": n_full,
            "codebook_sizes": g.codebook_sizes,
            "added_tokens": [codec.token(lv, c) for lv, c in codes_added(sizes, g.codebook_sizes)],
            "parent_hash": job.parent.hash, "new_hash": version.hash}


def _new_pairs(job: Job, assigned: set[str]):
    """(the new items' rendered pairs in PAIRS_SCHEMA, how many were truncated)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from gti.data.schemas import PAIRS_SCHEMA
    from gti.lm.pairs import RenderPairs
    from gti.sid.codec import SidCodec

    pf = Manifest.read(job.run_dir / "pairs").facts
    tok = job.tokenizer()
    table = SidCodec.from_facts(job.map_facts()).code_to_token_id_table(tok).numpy()
    wrap = tuple(pf["sid_markers"]) if pf.get("sid_markers") else None
    items = pq.read_table(str(job.work / "ingest" / "items.parquet"))
    items = items.filter(pc.is_in(items.column("item_id"), pa.array(sorted(assigned), pa.string())))
    smap = pq.read_table(str(job.work / "sid" / "sid_map.parquet"))
    code_of = dict(zip(smap.column("item_id").to_pylist(), smap.column("codes").to_pylist()))
    items = items.append_column("codes", pa.array([code_of[i] for i in items.column("item_id").to_pylist()],
                                                  pa.list_(pa.int32())))
    render = RenderPairs(tok, table, job.cfg.pairs.model_dump(), job.cfg.seed, wrap, set())
    blocks = [render(items.slice(s, 256)) for s in range(0, items.num_rows, 256)]
    new = pa.concat_tables(blocks) if blocks else PAIRS_SCHEMA.empty_table()
    truncated = int(pc.sum(new.column("truncated")).as_py() or 0) if "truncated" in new.column_names else 0
    return new.select(PAIRS_SCHEMA.names).cast(PAIRS_SCHEMA), truncated


def pairs_step(job: Job) -> dict:
    """Step 5: the new items' grounding pairs (`_new_pairs`: the pairs stage's renderer
    `gti.lm.pairs.RenderPairs`, same templates, the tokenizer of `job.base_model_dir`, the new
    map's codec) -> `pairs_new.parquet`, plus `refresh.replay_ratio` x as many old training pairs
    (a seeded sample of the run's and earlier refreshes' pairs) -> `pairs.parquet`."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from gti.data.schemas import PAIRS_SCHEMA

    cfg = job.cfg
    assigned = set(job.assigned())
    new, truncated = _new_pairs(job, assigned)
    pq.write_table(new, str(job.work / "pairs_new.parquet"))
    n_new_train = int(pc.sum(pc.equal(new.column("split"), "train")).as_py() or 0)
    pool = pa.concat_tables([pq.read_table(str(p)).select(PAIRS_SCHEMA.names).cast(PAIRS_SCHEMA)
                             for p in job.parent.pair_files])
    pool = pool.filter(pc.equal(pool.column("split"), "train"))
    n_rep = min(pool.num_rows, int(round(cfg.refresh.replay_ratio * n_new_train)))
    rng = np.random.default_rng([cfg.seed, job.k, 0x2EF])
    rows = np.sort(rng.choice(pool.num_rows, size=n_rep, replace=False)) if n_rep else np.zeros(0, np.int64)
    replay = pool.take(pa.array(rows, pa.int64()))
    pq.write_table(pa.concat_tables([new, replay]), str(job.work / "pairs.parquet"))
    job.log(f"pairs: {new.num_rows} pairs of {len(assigned)} new items ({n_new_train} train), "
            f"{n_rep} replayed old pairs (refresh.replay_ratio={cfg.refresh.replay_ratio:g})")
    return {"new_pairs": new.num_rows, "new_train_pairs": n_new_train, "replay_pairs": n_rep,
            "truncated_pairs": truncated}
