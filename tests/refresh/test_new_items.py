"""gti.refresh.new_items: embeddings by the run's encoder, SIDs from the frozen quantiser that never
move an old one (a full prefix group grows the last level for it by default,
`refresh.on_full_group=add_tokens`, or with `error` stops the refresh with the list written), and the replay
sample of old training pairs (on the fake run of conftest.py: codes (a, b) for a vector
(10a, b); the map's de-duplication level holds 2 items per group, (0, 0) is full)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gti.refresh.attempt import NEEDS_NEW_TOKENS, RefreshError
from gti.refresh.new_items import assign_step, embed_step, pairs_step


def _items(job, ids):
    (job.work / "ingest").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"item_id": ids, "title": [f"Title {i}" for i in ids], "description": [None] * len(ids),
                             "category": ["Lab"] * len(ids), "attributes_text": [None] * len(ids)},
                            schema=pa.schema([(c, pa.string()) for c in
                                              ("item_id", "title", "description", "category", "attributes_text")])),
                   str(job.work / "ingest" / "items.parquet"))


def _embeddings(job, vecs: dict[str, tuple[float, float]]):
    (job.work / "embed").mkdir(parents=True, exist_ok=True)
    flat = pa.array([float(x) for v in vecs.values() for x in v], pa.float32())
    pq.write_table(pa.table({"item_id": list(vecs), "embedding": pa.FixedSizeListArray.from_arrays(flat, 2)}),
                   str(job.work / "embed" / "embeddings.parquet"))


def test_embed_uses_the_runs_encoder_and_checks_its_dim(make_job, fake_run):
    job = make_job()
    _items(job, ["n1", "n2", "n3"])
    f = embed_step(job)
    assert f == {"n_items": 3, "dim": 16, "encoder": "hash"}
    t = pq.read_table(str(job.work / "embed" / "embeddings.parquet"))
    assert t.column("item_id").to_pylist() == ["n1", "n2", "n3"] and t.schema.field("embedding").type.list_size == 16
    with pytest.raises(RefreshError, match="the encoder gives dim 8 but the run's embeddings have 16"):
        embed_step(make_job("unused.csv", None, "embed.dim=8"))


def test_assign_keeps_old_sids_and_records_the_version(make_job, fake_run):
    from gti.sid.versions import read_version

    job = make_job()
    _embeddings(job, {"n2": (10, 2), "n3": (30, 1), "a3": (0, 1)})
    f = assign_step(job)
    t = pq.read_table(str(job.work / "sid" / "sid_map.parquet"))
    codes = dict(zip(t.column("item_id").to_pylist(), t.column("codes").to_pylist()))
    assert codes["n2"] == [1, 2, 1]  # a2 holds (1, 2, 0): the smallest free code of the group
    assert codes["n3"] == [3, 1, 0] and codes["a3"] == [2, 1, 0]  # a3 is known: its SID is kept
    assert f["assigned"] == 2 and f["already_present"] == 1 and f["prefix_changed"] == 1
    assert f["needs_new_tokens"] == 0 and f["parent_hash"] == fake_run.map_hash
    v = read_version(job.work / "sid" / "sid_map.parquet")
    assert v.parent_hash == fake_run.map_hash and v.hash == f["new_hash"] and v.codebooks_hash == "cbhash"
    assert v.note == "refresh v1: +2 items"
    listed = json.loads((job.work / "sid" / "new_items.json").read_text())
    assert listed == {"assigned": ["n2", "n3"], "already_present": ["a3"], "prefix_changed": ["a3"], "on_new_codes": []}
    assert f["codebook_sizes"] == [4, 4, 2] and f["added_tokens"] == [] and v.codebook_sizes == (4, 4, 2)


def test_a_full_prefix_group_stops_with_the_list_written(make_job):
    job = make_job("unused.csv", None, "refresh.on_full_group=error")  # opt-in since issue 51
    _embeddings(job, {"n1": (0, 0), "n2": (10, 2)})
    with pytest.raises(RefreshError, match=r"1 new item\(s\) need a SID token the vocabulary lacks \(e.g. 'n1'.*"
                                           r"refresh.on_full_group=error \(set refresh.on_full_group=add_tokens"):
        assign_step(job)
    listed = json.loads((job.work / NEEDS_NEW_TOKENS).read_text())
    assert [x["item_id"] for x in listed] == ["n1"] and listed[0]["codes"] == [0, 0]
    assert not (job.work / "sid" / "sid_map.parquet").exists()


def test_add_tokens_grows_the_last_level_for_a_full_group(make_job, fake_run):
    from gti.sid.versions import read_version

    job = make_job()  # the default: refresh.on_full_group=add_tokens
    # (0, 0) holds a0 and a1: both codes of the de-duplication level; n1, n4 and n5 need one more each
    _embeddings(job, {"n1": (0, 0), "n2": (10, 2), "n4": (0, 0), "n5": (0, 0), "n6": (30, 3)})
    f = assign_step(job)
    t = pq.read_table(str(job.work / "sid" / "sid_map.parquet"))
    codes = dict(zip(t.column("item_id").to_pylist(), t.column("codes").to_pylist()))
    assert codes["n1"] == [0, 0, 2] and codes["n4"] == [0, 0, 3] and codes["n5"] == [0, 0, 4]
    assert codes["n2"] == [1, 2, 1] and codes["n6"] == [3, 3, 1]
    old = pq.read_table(str(fake_run.dir / "sid" / "sid_map.parquet"))
    assert t.slice(0, old.num_rows).column("sid").to_pylist() == old.column("sid").to_pylist()  # old SIDs kept
    assert len(set(t.column("sid").to_pylist())) == t.num_rows
    assert f["assigned"] == 5 and f["needs_new_tokens"] == 3
    assert f["codebook_sizes"] == [4, 4, 5] and f["added_tokens"] == ["<c_2>", "<c_3>", "<c_4>"]
    v = read_version(job.work / "sid" / "sid_map.parquet")
    assert v.codebook_sizes == (4, 4, 5) and v.parent_hash == fake_run.map_hash and v.hash == f["new_hash"]
    assert v.note == "refresh v1: +5 items, +3 last-level codes"
    assert job.map_facts()["codebook_sizes"] == [4, 4, 5] and job.sf["codebook_sizes"] == [4, 4, 2]
    listed = json.loads((job.work / NEEDS_NEW_TOKENS).read_text())  # reported, though placed
    assert [x["item_id"] for x in listed] == ["n1", "n4", "n5"]
    new_items = json.loads((job.work / "sid" / "new_items.json").read_text())
    assert new_items["assigned"] == ["n2", "n6", "n1", "n4", "n5"] and new_items["on_new_codes"] == ["n1", "n4", "n5"]
    assert any("the last level grows from 2 to 5 codes" in m for m in job.logs)


def test_last_level_costs_are_widened_to_a_grown_level():
    import torch

    from gti.refresh.new_items import _padded_cost

    cost = torch.tensor([[0.5, 0.1], [0.0, 0.2]])
    wide = _padded_cost(cost, 4)
    assert wide.shape == (2, 4) and torch.equal(wide[:, :2], cost) and torch.isinf(wide[:, 2:]).all()
    assert _padded_cost(cost, 2) is cost and _padded_cost(None, 4) is None


def _new_pairs_table():
    from gti.data.schemas import PAIRS_SCHEMA

    n = 4
    return pa.table({"item_id": ["n1"] * n, "task": ["title2sid"] * n, "split": ["train", "train", "train", "val"],
                     **{c: [[9]] * n for c in PAIRS_SCHEMA.names[3:]}}, schema=PAIRS_SCHEMA)


@pytest.mark.parametrize("ratio, n_rep", [(1.0, 3), (0.0, 0), (5.0, 4)])
def test_pairs_replay_a_seeded_sample_of_old_training_pairs(make_job, monkeypatch, ratio, n_rep):
    import gti.refresh.new_items as new_items

    monkeypatch.setattr(new_items, "_new_pairs", lambda job, assigned: (_new_pairs_table(), 1))
    job = make_job("unused.csv", None, f"refresh.replay_ratio={ratio}")
    (job.work / "sid").mkdir()
    (job.work / "sid" / "new_items.json").write_text(json.dumps({"assigned": ["n1"]}))
    f = pairs_step(job)
    assert f == {"new_pairs": 4, "new_train_pairs": 3, "replay_pairs": n_rep, "truncated_pairs": 1}
    assert pq.read_table(str(job.work / "pairs_new.parquet")).equals(_new_pairs_table())
    both = pq.read_table(str(job.work / "pairs.parquet"))
    assert both.num_rows == 4 + n_rep
    replay = both.slice(4)
    assert set(replay.column("split").to_pylist()) <= {"train"}  # the run's val pairs are never replayed
    assert set(replay.column("item_id").to_pylist()) <= {"a0", "a1", "a2", "a3"}
    assert pairs_step(job) == f and pq.read_table(str(job.work / "pairs.parquet")).equals(both)  # seeded


def test_items_all_already_in_the_map_stop_with_one_line(make_job, fake_run):
    """The same map again would be a version that is its own parent (a lineage cycle)."""
    job = make_job()
    _embeddings(job, {"a3": (20, 1), "a0": (0, 0)})
    with pytest.raises(RefreshError, match=rf"nothing to refresh: all 2 item\(s\) given are already in map "
                                           rf"{fake_run.map_hash}"):
        assign_step(job)
    assert not (job.work / "sid" / "sid_map.parquet").exists()


def test_publish_killed_before_the_rename_leaves_a_reusable_work_folder(make_job, monkeypatch, tmp_path):
    """The work folder keeps its fingerprint until it is `v<k>`: a kill in between must not make
    the rerun empty it (every finished step would be recomputed)."""
    from pathlib import Path

    from gti.refresh.command import _publish
    from gti.refresh.attempt import FINGERPRINT_FILE
    from gti.sid.versions import LineageDir, read_version

    job = make_job()
    (job.work / FINGERPRINT_FILE).write_text("fp")
    _embeddings(job, {"n3": (30, 1)})
    assign_step(job)
    version = read_version(job.work / "sid" / "sid_map.parquet")
    lin = LineageDir(tmp_path / "lineage")

    def killed(self, target):
        raise KeyboardInterrupt("killed")

    with monkeypatch.context() as m:
        m.setattr(Path, "rename", killed)
        with pytest.raises(KeyboardInterrupt):
            _publish(job, lin, version)
    assert (job.work / FINGERPRINT_FILE).read_text() == "fp"
    final = _publish(job, lin, version)
    assert final.name == "v1" and not job.work.exists() and not (final / FINGERPRINT_FILE).exists()
    assert (final / "sid" / "sid_map.parquet").is_file() and lin.get(version.hash) == version
