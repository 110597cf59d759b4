"""The evaluation's reference-row config (gti/config/eval.py, held by gti.config's RunConfig):
`eval.baselines` defaults to MostPop, Markov and SASRec, names are checked, and `eval.sasrec`
rejects settings SASRec cannot run; the exact-rank and cold-slice keys' defaults and bounds."""

from __future__ import annotations

import pytest

from gti import config as C
from gti.config.eval import BASELINES
from gti.common.errors import ConfigError


def test_baselines_default_to_all_three_rows():
    ec = C.load(None).eval
    assert ec.baselines == ["mostpop", "markov", "sasrec"] == list(BASELINES)
    assert ec.sasrec.loss == "ce" and ec.sasrec.epochs >= 1 and ec.sasrec.val_users
    assert C.load(None, ["eval.baselines=[mostpop]"]).eval.baselines == ["mostpop"]
    assert C.load(None, ["eval.baselines=[]"]).eval.baselines == []


def test_unknown_or_repeated_names_and_bad_sasrec_settings_fail_naming_the_key():
    with pytest.raises(ConfigError, match="eval.baselines"):
        C.load(None, ["eval.baselines=[mostpop,gru4rec]"])
    with pytest.raises(ConfigError, match="eval.baselines"):
        C.load(None, ["eval.baselines=[markov,markov]"])
    with pytest.raises(ConfigError, match="eval.sasrec"):
        C.load(None, ["eval.sasrec.dim=10", "eval.sasrec.heads=3"])
    with pytest.raises(ConfigError, match="eval.sasrec.epochs"):
        C.load(None, ["eval.sasrec.epochs=0"])
    with pytest.raises(ConfigError, match="eval.sasrec.nope"):
        C.load(None, ["eval.sasrec.nope=1"])


def test_exact_rank_and_cold_slice_defaults_and_overrides():
    ec = C.load(None).eval
    assert ec.exact_rank is False and ec.cold_max_sft_targets == 1
    ec = C.load(None, ["eval.exact_rank=true", "eval.cold_max_sft_targets=0"]).eval
    assert ec.exact_rank is True and ec.cold_max_sft_targets == 0
    with pytest.raises(ConfigError, match="eval.cold_max_sft_targets"):
        C.load(None, ["eval.cold_max_sft_targets=-1"])


def test_trie_normalisation_is_refused_where_scores_would_disagree():
    assert C.load(None).eval.normalise == "vocab"
    assert C.load(None, ["eval.normalise=trie"]).eval.normalise == "trie"
    with pytest.raises(ConfigError, match="eval.constrained"):
        C.load(None, ["eval.normalise=trie", "eval.constrained=false"])
    with pytest.raises(ConfigError, match="exact_rank"):
        C.load(None, ["eval.normalise=trie", "eval.exact_rank=true"])
    with pytest.raises(ConfigError, match="eval.normalise"):
        C.load(None, ["eval.normalise=softmax"])
