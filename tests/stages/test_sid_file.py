"""The `sid` stage with `sid.method: file` (gti/stages/sid.py, gti/sid/file_map.py), without Ray:
a map read from MiniOneRec's index.json form gives the stage's usual outputs and hash, and
round-trips through `gti sid export` to the same hash."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gti import config as C
from gti.cli import main
from gti.common.errors import ConfigError, DataError
from gti.run.manifest import Manifest
from gti.run.pipeline import fingerprint, run_stage, spec

IDS = [f"item{i}" for i in range(12)]


def write_embed_stage(run_dir, n: int = len(IDS), dim: int = 8):
    """A finished `embed` stage holding random embeddings of IDS (as tests/stages/test_sid.py's)."""
    d = run_dir / "embed"
    d.mkdir(parents=True)
    flat = pa.array(np.random.default_rng(0).normal(size=n * dim).astype(np.float32))
    pq.write_table(pa.table({"item_id": IDS[:n], "embedding": pa.FixedSizeListArray.from_arrays(flat, dim)}),
                   d / "embeddings.parquet")
    Manifest(stage="embed", fingerprint=f"test-{n}-{dim}", config={}, facts={"dim": dim, "n_items": n},
             outputs={"embeddings": "embeddings.parquet"}).write(d)


def _index(n_dup: int = 0) -> dict[str, list[str]]:
    """index.json of IDS: 3 levels, the first `n_dup` items sharing one SID."""
    out = {i: [f"<a_{k % 3}>", f"<b_{k % 4}>", f"<c_{k // 4}>"] for k, i in enumerate(IDS)}
    for i in IDS[1:n_dup]:
        out[i] = out[IDS[0]]
    return out


def _run(tmp_path, name, path, *over):
    cfg = C.load(None, [f"run_dir={tmp_path / name}", "sid.method=file", f"sid.path={path}", *over])
    run_dir = cfg.resolved_run_dir()
    if not (run_dir / "embed").exists():
        write_embed_stage(run_dir)
    return run_stage(spec("sid"), cfg, run_dir), run_dir


def _write(path, obj):
    path.write_text(json.dumps(obj))
    return path


def test_a_file_map_runs_the_stage_without_ray_and_writes_what_a_built_map_writes(tmp_path):
    m, run_dir = _run(tmp_path, "run", _write(tmp_path / "d.index.json", _index(n_dup=3)))
    f = m.facts
    t = pq.read_table(run_dir / "sid" / "sid_map.parquet")
    assert t.column("item_id").to_pylist() == IDS and len(set(t.column("sid").to_pylist())) == len(IDS)
    assert f["method"] == "file" and f["levels"] == 4 and f["codebook_sizes"] == [3, 4, 3, 3]
    assert f["quantizer_levels"] == 3 and f["dedup_level_added"] and f["n_items"] == len(IDS)
    assert len(f["new_tokens"]) == sum(f["codebook_sizes"]) and f["token_format"] == "<{level}_{code}>"
    assert set(m.outputs) == {"sid_map", "codebooks", "quarantine"}
    from gti.sid.codec import SidCodec

    codec = SidCodec.from_facts(f)  # what pairs, ground, sft and evaluate build from the facts
    assert codec.from_string(t.column("sid")[5].as_py()) == t.column("codes")[5].as_py()
    assert not (run_dir / "sid" / "quantizer.safetensors").exists()


@pytest.mark.parametrize("item_json", [False, True])
def test_a_file_map_round_trips_through_gti_sid_export_to_the_same_hash(tmp_path, item_json, capsys):
    first, run_dir = _run(tmp_path, "a", _write(tmp_path / "d.index.json", _index(n_dup=2)))
    out, names = tmp_path / "out.index.json", tmp_path / "out.item.json"
    argv = ["sid", "export", "--run-dir", str(run_dir), "--out", str(out)] + (["--item-json", str(names)] if item_json
                                                                              else [])
    assert main(argv) == 0
    assert f"12 items, 4 levels (map {first.facts['sid_map_hash']})" in capsys.readouterr().out
    again, run_b = _run(tmp_path, "b", out, *([f"sid.item_json={names}"] if item_json else []))
    assert again.facts["sid_map_hash"] == first.facts["sid_map_hash"]
    assert again.facts["dedup_level_added"] is False  # the exported map has the appended level as its own
    assert main(["sid", "export", "--run-dir", str(run_b), "--out", str(tmp_path / "again.json")]
                + (["--item-json", str(names)] if item_json else [])) == 0
    assert (tmp_path / "again.json").read_text() == out.read_text()


def test_errors_name_the_item(tmp_path):
    bad = _index()
    bad["item4"] = ["<a_1>", "<b_0>"]
    with pytest.raises(DataError, match=r"item 'item4' has 2 codes where the map's others have 3"):
        _run(tmp_path, "levels", _write(tmp_path / "l.json", bad))
    del bad["item4"]
    with pytest.raises(DataError, match=r"1 catalog item\(s\) have no SID: 'item4'"):
        _run(tmp_path, "missing", _write(tmp_path / "m.json", bad))
    with pytest.raises(DataError, match=r"items 'item0' and 'item1' share the SID <a_0><b_0><c_0>"):
        _run(tmp_path, "dup", _write(tmp_path / "d.json", _index(n_dup=2)), "sid.duplicates=error")
    with pytest.raises(DataError, match=r"sid.path .*nothing.json: no such file"):
        _run(tmp_path, "none", tmp_path / "nothing.json")
    assert not (tmp_path / "dup" / "sid").exists()


def test_the_map_file_is_in_the_fingerprint_and_the_new_keys_leave_old_ones_as_they_were(tmp_path):
    sid = C.load(None, []).model_dump(mode="json")["sid"]
    assert not {"path", "item_json", "token_pattern", "file_codebook_size", "missing", "duplicates"} & set(sid)
    path = _write(tmp_path / "d.index.json", _index())
    cfg = C.load(None, [f"run_dir={tmp_path / 'run'}", "sid.method=file", f"sid.path={path}"])
    write_embed_stage(cfg.resolved_run_dir())
    before = fingerprint(spec("sid"), cfg, cfg.resolved_run_dir())[0]
    _write(path, _index(n_dup=2))
    assert fingerprint(spec("sid"), cfg, cfg.resolved_run_dir())[0] != before
    with pytest.raises(ConfigError, match="sid.method=file needs sid.path"):
        C.load(None, ["sid.method=file"])


def test_export_of_a_run_without_a_sid_stage_is_one_line(tmp_path, capsys):
    assert main(["sid", "export", "--run-dir", str(tmp_path), "--out", str(tmp_path / "x.json")]) == 2
    assert "gti: error:" in capsys.readouterr().err
