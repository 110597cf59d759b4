"""Issue 30, item 6: config values that would fail hours into a run fail at validation, in one
line naming the key (`eval.ks` <= 0, a negative seed, a non-positive `sid.encoder_dims` entry,
an unbounded `sid.codebook_size`, `gti recommend --k` < 1 or unbounded)."""

from __future__ import annotations

import pytest

from gti import config as C
from gti.eval.recommend import MAX_K, check_k
from gti.common.errors import ConfigError


@pytest.mark.parametrize("override,key", [
    ("eval.ks=[0,5]", "eval.ks.0"),
    ("eval.ks=[5,-1]", "eval.ks.1"),
    ("eval.ks=[]", "eval.ks"),
    ("seed=-1", "seed"),
    (f"seed={2**32}", "seed"),
    ("eval.sample_seed=-3", "eval.sample_seed"),
    ("sid.encoder_dims=[512,0]", "sid.encoder_dims.1"),
    ("sid.encoder_dims=[-4]", "sid.encoder_dims.0"),
    (f"sid.codebook_size={C.MAX_CODEBOOK_SIZE + 1}", "sid.codebook_size"),
    ("sid.codebook_size=10000000", "sid.codebook_size"),
])
def test_bad_values_fail_at_validation_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        C.load(None, [override])
    msg = str(e.value)
    assert f"'{key}'" in msg and len(msg.splitlines()) == 1


def test_the_bounds_still_accept_sane_values():
    cfg = C.load(None, ["eval.ks=[1,10]", "seed=0", f"seed={2**32 - 1}", "sid.encoder_dims=[]",
                        "sid.encoder_dims=[8]", f"sid.codebook_size={C.MAX_CODEBOOK_SIZE}"])
    assert cfg.sid.codebook_size == C.MAX_CODEBOOK_SIZE and cfg.sid.encoder_dims == [8]
    assert C.load(None, ["eval.sample_seed=null"]).eval.sample_seed is None


def test_gti_config_validate_prints_one_line_naming_the_key(tmp_path, capsys):
    from gti.cli import main

    conf = tmp_path / "c.yaml"
    conf.write_text("eval:\n  ks: [10, 0]\n")
    assert main(["config", "validate", "--config", str(conf)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'eval.ks.1'" in err[0] and str(conf) in err[0]


def test_vocab_ground_seed_is_bounded_too():
    from gti.vocab_ground import load_config

    with pytest.raises(ConfigError, match="'seed'"):
        load_config(None, ["seed=-2"])


@pytest.mark.parametrize("k", ["0", "-3", str(MAX_K + 1), "ten"])
def test_recommend_k_out_of_range_fails_before_the_run_is_opened(k, tmp_path, capsys, monkeypatch):
    from gti.run import loaded as loaded_run
    from gti.cli import main

    monkeypatch.setattr(loaded_run.LoadedRun, "open", classmethod(lambda *a, **kw: pytest.fail("opened")))
    with pytest.raises(SystemExit) as e:
        main(["recommend", "--run-dir", str(tmp_path), "--history", "a", "--k", k])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --k" in err and f"between 1 and {MAX_K}" in err


def test_check_k():
    assert check_k(1) == 1 and check_k(MAX_K) == MAX_K
    for bad, what in [(0, ">= 1"), (MAX_K + 1, f"<= {MAX_K}"), (True, "integer"), (2.0, "integer")]:
        with pytest.raises(ConfigError, match=what):
            check_k(bad)
