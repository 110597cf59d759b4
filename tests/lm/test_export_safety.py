"""Issue 30, item 2: gti deletes only what it made.

`gti vocab ground --out D` (and every `export_model`) replaces D whole, so a non-empty folder
that is not a gti export is refused unless forced, a folder that is or contains the model, the
tokens file, the current or the home directory is refused always, and the swap leaves no moment
without a complete folder at D (gti.common.files.replace_dir). Also the stage swap of `gti run`
(gti.run.pipeline) and the default work dir of vocab ground."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gti.common import files
from gti.common.files import UnsafeReplaceError, check_replaceable_dir, replace_dir
from gti.lm import models
from gti.lm import new_rows as V


def _foreign(root: Path) -> Path:
    """A user's folder with a file in it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "thesis.tex").write_text("years of work")
    return root


def _tiny(tiny_model_cfg):
    return models.build_tiny(tiny_model_cfg(), seed=0)


def _exchange_supported(tmp_path: Path) -> bool:
    a, b = tmp_path / "xa", tmp_path / "xb"
    a.mkdir()
    b.mkdir()
    try:
        return files._exchange(a, b)
    finally:
        files.remove_path(a)
        files.remove_path(b)


# --------------------------------------------------------------------------- export_model
def test_export_refuses_a_foreign_folder_and_leaves_it_untouched(tmp_path, tiny_model_cfg):
    model, tok = _tiny(tiny_model_cfg)
    out = _foreign(tmp_path / "mine")
    with pytest.raises(UnsafeReplaceError, match=r"not a gti export.*--force"):
        V.export_model(model, tok, out, {"stage": "test"})
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]
    assert (out / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temp folder left beside it


def test_export_replaces_its_own_export_an_empty_folder_and_a_forced_one(tmp_path, tiny_model_cfg):
    model, tok = _tiny(tiny_model_cfg)
    out = tmp_path / "out"
    V.export_model(model, tok, out, {"v": 1})
    (out / "stale.txt").write_text("from the first export")
    V.export_model(model, tok, out, {"v": 2})  # an earlier gti export: replaced whole
    assert V.read_meta(out) == {"v": 2} and not (out / "stale.txt").exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    V.export_model(model, tok, empty, {"v": 3})
    assert V.read_meta(empty) == {"v": 3}

    forced = _foreign(tmp_path / "forced")
    V.export_model(model, tok, forced, {"v": 4}, force=True)
    assert V.read_meta(forced) == {"v": 4} and not (forced / "thesis.tex").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "forced", "out"]


def _foreign_cwd_and_home(tmp_path, monkeypatch):
    """A user's folders as the current and the home directory; returns (cwd, home)."""
    cwd, home = _foreign(tmp_path / "cwd"), _foreign(tmp_path / "home")
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    return cwd, home


def test_export_never_replaces_the_cwd_home_or_a_protected_input_even_forced(tmp_path, tiny_model_cfg,
                                                                            monkeypatch):
    model, tok = _tiny(tiny_model_cfg)
    work, home = _foreign_cwd_and_home(tmp_path, monkeypatch)
    base = tmp_path / "base" / "model"
    base.mkdir(parents=True)
    for out, why in [(Path("."), "current directory"), (work.parent, "current directory"),
                     (home, "home directory"), (base, "--model"), (base.parent, "--model")]:
        with pytest.raises(UnsafeReplaceError, match=why):
            V.export_model(model, tok, out, {}, force=True, protected={"--model": base})
    assert (work / "thesis.tex").is_file() and (home / "thesis.tex").is_file() and base.is_dir()


def test_a_failed_export_keeps_the_previous_one(tmp_path, tiny_model_cfg):
    model, tok = _tiny(tiny_model_cfg)
    out = tmp_path / "out"
    V.export_model(model, tok, out, {"v": 1})

    def boom(tmp):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        V.export_model(model, tok, out, {"v": 2}, extra=boom)
    assert V.read_meta(out) == {"v": 1} and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_extra_files_are_in_the_folder_before_it_appears(tmp_path, tiny_model_cfg):
    model, tok = _tiny(tiny_model_cfg)
    out = tmp_path / "out"
    seen = []

    def extra(tmp):
        seen.append(out.exists())
        (tmp / "rows.bin").write_bytes(b"x")

    V.export_model(model, tok, out, {}, extra=extra)
    assert seen == [False] and (out / "rows.bin").read_bytes() == b"x"


# --------------------------------------------------------------------------- replace_dir
def test_replace_dir_exchanges_in_one_step_where_the_kernel_can(tmp_path, monkeypatch):
    if not _exchange_supported(tmp_path):
        pytest.skip("no renameat2(RENAME_EXCHANGE) here: the two-rename fallback is tested below")
    dst, new = tmp_path / "dst", tmp_path / ".dst.new"
    dst.mkdir()
    (dst / "v").write_text("old")
    new.mkdir()
    (new / "v").write_text("new")
    renames = []
    real = os.rename
    monkeypatch.setattr(files.os, "rename", lambda a, b: (renames.append((a, b)), real(a, b)))
    replace_dir(new, dst)
    # No rename (dst moved away, then the new one in): one exchange, so dst was never missing.
    assert renames == []
    assert (dst / "v").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_replace_dir_fallback_puts_the_old_folder_back_when_the_new_one_cannot_go_in(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    dst, new = tmp_path / "dst", tmp_path / ".dst.new"
    dst.mkdir()
    (dst / "v").write_text("old")
    new.mkdir()
    (new / "v").write_text("new")
    real = os.rename

    def failing(a, b):
        if Path(a) == new:
            raise OSError(5, "I/O error")
        return real(a, b)

    monkeypatch.setattr(files.os, "rename", failing)
    with pytest.raises(OSError):
        replace_dir(new, dst)
    assert (dst / "v").read_text() == "old"
    monkeypatch.setattr(files.os, "rename", real)
    replace_dir(new, dst)
    assert (dst / "v").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_replace_dir_over_a_symlink_removes_the_link_not_its_target(tmp_path):
    target = _foreign(tmp_path / "target")
    link = tmp_path / "link"
    link.symlink_to(target)
    new = tmp_path / ".link.new"
    new.mkdir()
    (new / "v").write_text("new")
    replace_dir(new, link)
    assert not link.is_symlink() and (link / "v").read_text() == "new"
    assert (target / "thesis.tex").read_text() == "years of work"


def test_check_refuses_a_file_even_forced(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    with pytest.raises(UnsafeReplaceError, match="is not a folder"):
        check_replaceable_dir(f, is_ours=lambda p: True, force=True)


# --------------------------------------------------------------------------- gti vocab ground
def _tokens_file(tmp_path: Path) -> Path:
    p = tmp_path / "tokens.jsonl"
    p.write_text('{"token": "<tool_x>", "descriptions": ["search the web"]}\n')
    return p


def _vocab_cli(*args: str) -> int:
    from gti.cli import main

    return main(["vocab", "ground", *args])


def test_cli_refuses_a_foreign_out_before_any_work_and_leaves_it_untouched(tmp_path, capsys, monkeypatch):
    from gti import vocab_ground

    def no_work(*a, **k):
        raise AssertionError("the model was loaded although --out is refused")

    monkeypatch.setattr(vocab_ground, "_load_and_extend", no_work)
    out = _foreign(tmp_path / "results")
    model = tmp_path / "model"
    model.mkdir()
    rc = _vocab_cli("--model", str(model), "--tokens", str(_tokens_file(tmp_path)), "--out", str(out))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("gti: error: --out ") and str(out) in err[0] and "--force" in err[0]
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]
    assert not (tmp_path / ".results.work").exists()  # no work dir made for a refused call


@pytest.mark.parametrize("which", ["cwd", "home", "model", "above_model", "tokens_dir"])
def test_cli_refuses_out_that_is_or_contains_cwd_home_model_or_tokens_even_forced(tmp_path, capsys,
                                                                                  monkeypatch, which):
    from gti import vocab_ground

    monkeypatch.setattr(vocab_ground, "_load_and_extend", lambda *a, **k: pytest.fail("model loaded"))
    cwd, home = _foreign_cwd_and_home(tmp_path, monkeypatch)
    model = tmp_path / "models" / "base"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    tok_dir = tmp_path / "toks"
    tok_dir.mkdir()
    tokens = _tokens_file(tok_dir)
    out = {"cwd": ".", "home": "~", "model": str(model), "above_model": str(model.parent),
           "tokens_dir": str(tok_dir)}[which]
    rc = _vocab_cli("--model", str(model), "--tokens", str(tokens), "--out", out, "--force")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("gti: error: --out") and len(err.splitlines()) == 1
    assert (cwd / "thesis.tex").is_file() and (home / "thesis.tex").is_file()
    assert (model / "config.json").is_file() and tokens.is_file()


def test_force_lets_a_foreign_out_through_the_check(tmp_path):
    from gti.vocab_ground import _check_out, _protected

    out = _foreign(tmp_path / "results")
    with pytest.raises(UnsafeReplaceError):
        _check_out(out, False, _protected("smollm2-135m", [], None))
    _check_out(out, True, _protected("smollm2-135m", [], None))  # no error: forced


def test_smollm2_cache_folder_is_protected(tmp_path, monkeypatch):
    from gti.vocab_ground import _check_out, _protected

    monkeypatch.setenv("GTI_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UnsafeReplaceError, match="--model"):
        _check_out(tmp_path / "cache", True, _protected("smollm2-135m", [], None))


def test_default_work_dir_of_another_owner_is_refused_and_never_removed(tmp_path):
    from gti.common.errors import DataError
    from gti.vocab_ground import WORK_MARKER, _open_work

    work = _foreign(tmp_path / ".out.work")
    with pytest.raises(DataError, match="not made by gti vocab ground"):
        _open_work(work, own=True)
    assert sorted(p.name for p in work.iterdir()) == ["thesis.tex"]
    mine = tmp_path / ".other.work"
    _open_work(mine, own=True)
    assert (mine / WORK_MARKER).is_file()
    _open_work(mine, own=True)  # a rerun of the same call reuses it


# --------------------------------------------------------------------------- gti run's stage swap
def test_a_run_dir_with_a_users_folder_named_like_a_stage_is_refused_before_anything_runs(tmp_path):
    from gti import config as C
    from gti.run import pipeline as P

    run_dir = tmp_path / "project"
    _foreign(run_dir / "ingest")
    cfg = C.load(None, [f"run_dir={run_dir}"])
    with pytest.raises(P.PipelineError, match=r"stage 'ingest' folder .* not a gti stage folder"):
        P.run(cfg, to_stage="ingest", echo=lambda m: None)
    assert sorted(p.name for p in (run_dir / "ingest").iterdir()) == ["thesis.tex"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["ingest"]  # not even config.yaml written
