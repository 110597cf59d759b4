"""gti.refresh.tokens and what follows it without training: on the fake run of conftest.py, with
a real tiny model as the parent (SID tokens for sizes [4, 4, 2], rows distinct as after
grounding), `refresh.on_full_group=add_tokens` and a full prefix group: the added code tokens
reach the tokenizer and the model (rows at the level's mean, old rows unchanged), the later
steps start from that model, and with `refresh.ground_steps=0` the export is it, loadable with
the grown map while the parent's model is refused with one line."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gti import config as C
from gti.run.manifest import Manifest


def _tiny_parent(fake_run):
    """Replace the fake run's model folder by a tiny model with the run's SID tokens; the pairs
    manifest gets its `new_token_ids`. Returns [first, end)."""
    from gti.lm import new_rows as V
    from gti.lm.models import build_tiny
    from gti.sid.codec import SidCodec

    model, tok = build_tiny(C.ModelConfig(name="tiny", tiny_hidden=32, tiny_layers=1, tiny_heads=2,
                                          tiny_tied=False), seed=0)
    first, end = V.extend_tokenizer(tok, SidCodec(3, [4, 4, 2]).tokens())
    g = torch.Generator().manual_seed(5)
    d = model.config.hidden_size
    V.attach_new_rows(model, first, end - first, torch.randn(end - first, d, generator=g),
                      torch.randn(end - first, d, generator=g))
    V.export_model(model, tok, fake_run.model_dir, {"sid_map_hash": fake_run.map_hash, "new_token_ids": [first, end]})
    pairs = fake_run.dir / "pairs"
    m = Manifest.read(pairs)
    Manifest(stage="pairs", fingerprint="test", config={}, outputs=m.outputs,
             facts=dict(m.facts, new_token_ids=[first, end])).write(pairs)
    return first, end


def _grown_job(make_job, fake_run, *overrides):
    from gti.refresh.new_items import assign_step

    first, end = _tiny_parent(fake_run)
    job = make_job("unused.csv", None, "refresh.on_full_group=add_tokens", *overrides)
    (job.work / "embed").mkdir(parents=True, exist_ok=True)
    vecs = {"n1": (0.0, 0.0), "n2": (0.0, 0.0), "n3": (10.0, 2.0)}  # (0, 0) is full: n1, n2 need a token
    flat = pa.array([x for v in vecs.values() for x in v], pa.float32())
    pq.write_table(pa.table({"item_id": list(vecs), "embedding": pa.FixedSizeListArray.from_arrays(flat, 2)}),
                   str(job.work / "embed" / "embeddings.parquet"))
    assert assign_step(job)["added_tokens"] == ["<c_2>", "<c_3>"]
    return job, first, end


def _rows(model_dir):
    from safetensors.torch import load_file

    w = load_file(str(model_dir / "model.safetensors"))
    return w[next(k for k in w if k.endswith("embed_tokens.weight"))], w["lm_head.weight"]


def test_tokens_step_appends_the_added_codes_at_their_levels_mean(make_job, fake_run):
    from transformers import AutoTokenizer

    from gti.lm.new_rows import read_meta
    from gti.refresh.attempt import GROWN_MODEL
    from gti.refresh.tokens import tokens_step

    job, first, end = _grown_job(make_job, fake_run)
    assert job.base_model_dir == fake_run.model_dir and job.token_range() == (first, end)
    f = tokens_step(job)
    assert f == {"added_tokens": 2, "tokens": ["<c_2>", "<c_3>"], "added_token_ids": [end, end + 2],
                 "new_token_ids": [first, end + 2], "codebook_sizes": [4, 4, 4]}
    grown = job.work / GROWN_MODEL
    assert job.base_model_dir == grown and job.token_range() == (first, end + 2)
    tok = AutoTokenizer.from_pretrained(str(grown))
    assert tok.convert_tokens_to_ids(["<c_2>", "<c_3>"]) == [end, end + 1]
    assert job.tokenizer().convert_tokens_to_ids("<c_3>") == end + 1
    (old_in, old_out), (new_in, new_out) = _rows(fake_run.model_dir), _rows(grown)
    assert torch.equal(new_in[:end], old_in[:end]) and torch.equal(new_out[:end], old_out[:end])
    c_rows = tok.convert_tokens_to_ids(["<c_0>", "<c_1>"])  # level c's rows before
    for i in (end, end + 1):
        assert torch.equal(new_in[i], old_in[c_rows].mean(0)) and torch.equal(new_out[i], old_out[c_rows].mean(0))
    meta = read_meta(grown)
    assert meta["sid_map_hash"] == fake_run.map_hash and meta["new_token_ids"] == [first, end + 2]
    assert meta["added_tokens"] == ["<c_2>", "<c_3>"] and meta["codebook_sizes"] == [4, 4, 4]
    # the later steps spell the new map with the grown codec and that model's tokenizer
    from gti.sid.codec import SidCodec

    table = SidCodec.from_facts(job.map_facts()).code_to_token_id_table(job.tokenizer())
    assert table[2, :4].tolist() == [end - 2, end - 1, end, end + 1]


def test_without_added_codes_the_step_does_nothing(make_job, fake_run):
    from gti.refresh.new_items import assign_step
    from gti.refresh.tokens import tokens_step

    job = make_job("unused.csv", None, "refresh.on_full_group=add_tokens")
    (job.work / "embed").mkdir(parents=True, exist_ok=True)
    flat = pa.array([10.0, 2.0], pa.float32())
    pq.write_table(pa.table({"item_id": ["n3"], "embedding": pa.FixedSizeListArray.from_arrays(flat, 2)}),
                   str(job.work / "embed" / "embeddings.parquet"))
    assign_step(job)
    assert tokens_step(job) == {"added_tokens": 0}
    assert job.base_model_dir == fake_run.model_dir and not (job.work / "grown_model").exists()


def test_untrained_export_is_the_grown_model_and_only_it_takes_the_grown_map(make_job, fake_run):
    from transformers import AutoTokenizer

    from gti.lm.new_rows import read_meta
    from gti.refresh.command import export_step
    from gti.refresh.attempt import RefreshError
    from gti.refresh.tokens import tokens_step
    from gti.run.loaded import LoadedRun, map_codec
    from gti.run.versions import check_model_map, check_tokens, lineage_dir
    from gti.sid.versions import MissingSidTokensError, read_version

    job, first, end = _grown_job(make_job, fake_run, "refresh.ground_steps=0")
    with pytest.raises(RefreshError, match="adds code tokens but .*grown_model .* is missing"):
        export_step(job)  # (the tokens step has not run: never export the parent's model with the grown map)
    tokens_step(job)
    assert export_step(job) == {"model_source": "parent_with_added_tokens"}
    assert not (job.work / "grown_model").exists()
    model = job.work / "model"
    meta = read_meta(model)
    v = read_version(job.work / "sid" / "sid_map.parquet")
    assert meta["sid_map_hash"] == v.hash and meta["codebook_sizes"] == [4, 4, 4]
    assert meta["sid_map_version"]["codebook_sizes"] == [4, 4, 4] and meta["new_token_ids"] == [first, end + 2]
    assert export_step(job) == {"model_source": "parent_with_added_tokens"}  # a rerun after an interrupted export
    # the map's codec comes from its version record: the run's sid facts say [4, 4, 2]
    smap = job.work / "sid" / "sid_map.parquet"
    codec = map_codec(smap, job.sf)
    assert codec.codebook_sizes == [4, 4, 4]
    check_tokens(AutoTokenizer.from_pretrained(str(model)), codec, model, smap)
    with pytest.raises(MissingSidTokensError, match=r"lacks 2 SID token\(s\) .*<c_2>, <c_3>"):
        check_tokens(AutoTokenizer.from_pretrained(str(fake_run.model_dir)), codec, fake_run.model_dir, smap)
    # the parent's model is refused before anything loads, naming the tokens and both hashes
    lin = lineage_dir(fake_run.dir)
    from gti.refresh.command import _lineage_with_base

    _lineage_with_base(fake_run.dir, Manifest.read(fake_run.dir / "sid"), "cbhash")
    lin.add(v, pq.read_table(str(smap)))
    with pytest.raises(MissingSidTokensError) as e:
        check_model_map(fake_run.model_dir, v.hash, map_path=smap, lineage=lin)
    msg = str(e.value)
    assert "<c_2>, <c_3>" in msg and v.hash in msg and fake_run.map_hash in msg and "\n" not in msg
    assert check_model_map(model, v.hash, map_path=smap, lineage=lin) == 0
    run = LoadedRun._load(model, smap, job.sf, C.RunConfig(), "cpu")
    assert run.sid_matrix.shape == (len(run.item_ids), 3)
    ids = dict(zip(run.item_ids, run.sid_matrix.tolist()))
    assert ids["n1"][2] == end and ids["n2"][2] == end + 1  # the added tokens' ids in the trie
    assert json.loads((job.work / "sid" / "new_items.json").read_text())["on_new_codes"] == ["n1", "n2"]
