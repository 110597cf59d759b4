"""bench/common.py, the bench scripts' shared module: the catalog's random unique SIDs, the
noise rows, the bundled users as prompts (with a stand-in tokenizer, no model); and the layout
of bench/: one folder per topic, every script importing the shared module the same way, none
loading a sibling script, every one of them importable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from testkit import load_bench

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SCRIPTS = sorted(p.relative_to(BENCH).with_suffix("").as_posix() for p in BENCH.glob("*/*.py"))
HEADER = "sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module\n"


@pytest.fixture(scope="module")
def common():
    return load_bench("common")


def test_catalog_sids_are_unique_seeded_and_offset_per_level(common):
    import torch

    ids, codes = common.catalog_sids(500, 3, 8, first=100, seed=1)
    again, _ = common.catalog_sids(500, 3, 8, first=100, seed=1)
    other, _ = common.catalog_sids(500, 3, 8, first=100, seed=2)
    assert codes.shape == (500, 3) and len({tuple(r) for r in codes.tolist()}) == 500
    assert torch.equal(ids, again) and not torch.equal(ids, other)
    assert torch.equal(ids, codes + 100 + torch.arange(3) * 8)  # level l's tokens are [100 + 8l, 100 + 8l + 8)
    assert int(codes.min()) >= 0 and int(codes.max()) < 8


def test_catalog_sids_read_a_sid_map_and_refuse_one_that_does_not_fit(common, tmp_path):
    import polars as pl

    path = tmp_path / "sid_map.parquet"
    pl.DataFrame({"item_id": ["a", "b"], "codes": [[0, 1], [2, 3]]}).write_parquet(path)
    ids, codes = common.catalog_sids(2, 2, 4, first=10, seed=0, sid_map=str(path))
    assert codes.tolist() == [[0, 1], [2, 3]] and ids.tolist() == [[10, 15], [12, 17]]
    with pytest.raises(SystemExit, match="do not fit 2 levels x 3 codes"):
        common.catalog_sids(2, 2, 3, first=10, seed=0, sid_map=str(path))


def test_noise_rows_are_seeded_and_spread_like_the_old_rows(common):
    import torch

    old = torch.randn(2000, 4) * torch.tensor([1.0, 2.0, 3.0, 4.0]) + 5.0
    rows = common.noise_rows(old, 3000, seed=0)
    assert rows.shape == (3000, 4) and torch.equal(rows, common.noise_rows(old, 3000, seed=0))
    assert torch.allclose(rows.mean(0), old.mean(0), atol=0.3)
    assert torch.allclose(rows.std(0), old.std(0), rtol=0.1)


class _Tok:
    """Stands in for a chat tokenizer: the user message's characters as ids."""

    def apply_chat_template(self, msgs, add_generation_prompt, tokenize, return_dict):
        assert add_generation_prompt and tokenize and not return_dict
        assert msgs[0] == {"role": "system", "content": "You are a helpful assistant."}
        return [ord(c) for c in msgs[1]["content"]]


class _Codec:
    def to_string(self, codes):
        return "<" + ",".join(map(str, codes)) + ">"


def test_user_prompts_hold_the_last_training_items_and_target_the_test_item(common):
    import torch

    items = common.bundled_items()["item_id"].to_list()
    codes = torch.arange(len(items)).unsqueeze(1)  # item row r -> SID "<r>"
    prompts, targets = common.user_prompts(_Tok(), _Codec(), codes, n_users=3, history=2)
    seqs = [s for s in common.bundled_sequences()["item_id"].to_list() if len(s) >= 3][:3]
    row = {iid: i for i, iid in enumerate(items)}
    assert len(prompts) == len(targets) == 3
    for ids, target, seq in zip(prompts, targets, seqs):
        text = "".join(map(chr, ids))
        hist = "".join(f"<{row[i]}>" for i in seq[:-2][-2:])  # leave-one-out: valid and test held out
        assert text == common.TEMPLATE.format(history=hist) and target == row[seq[-1]]
    _, small = common.user_prompts(_Tok(), _Codec(), codes[:7], n_users=3, history=2)
    assert small == [t % 7 for t in targets]  # a catalog subset: rows modulo its size


def test_every_script_is_in_a_topic_folder_and_imports_the_shared_module_alike():
    """bench/<topic>/<script>.py only (bench/common.py is the one module beside RESULTS.md); a
    script that uses the shared module puts bench/ on sys.path with the one header line and
    `import common`; no script loads another by file path or imports a sibling."""
    assert sorted(p.name for p in BENCH.glob("*.py")) == ["common.py"]
    assert len(SCRIPTS) >= 15, SCRIPTS
    for name in SCRIPTS:
        text = (BENCH / f"{name}.py").read_text()
        assert "spec_from_file_location" not in text and "importlib.util" not in text, name
        assert ".resolve().parent))" not in text, name  # the script's own folder on sys.path
        if re.search(r"\bcommon\.", text):
            assert HEADER in text and "import common  # noqa: E402\n" in text, name
        assert not re.search(r"^\s*common\s*=", text, re.M), f"{name}: a local `common` shadows the module"
        siblings = {p.stem for p in (BENCH / name).parent.glob("*.py")} - {Path(name).name}
        for s in siblings:
            assert not re.search(rf"^\s*(from|import) {s}\b", text, re.M), f"{name} imports its sibling {s}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_imports(script):
    """Its module-level code runs (imports, the shared module, constants), not its main."""
    mod = load_bench(script)
    assert callable(getattr(mod, "main", None)), script
