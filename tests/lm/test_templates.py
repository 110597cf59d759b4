"""Rendering grounding pairs and recommendation prompts (gti/lm/templates.py)."""

from __future__ import annotations

import pytest

from gti.common.arms import DEFAULT_GROUNDING_TEMPLATES
from gti.common.errors import ConfigError
from gti.lm import templates as T
from gti.lm.chat import IGNORE, end_of_turn_ids, fit_segments
from gti.lm import new_rows as V
from gti.lm.models import build_tiny_tokenizer

SYS = "You are a helpful assistant."


@pytest.fixture(scope="module")
def tok_range():
    tok = build_tiny_tokenizer()
    first, end = V.extend_tokenizer(tok, [f"<{lvl}_{c}>" for lvl in "abc" for c in range(4)], markers=True)
    return tok, first, end


def test_all_six_tasks_answer_only_labels_and_codec_ids(tok_range):
    tok, first, end = tok_range
    r = T.PairRenderer(tok, DEFAULT_GROUNDING_TEMPLATES, SYS, max_len=128)
    sid = [first + 1, first + 6, first + 11]
    rows = r.render_item("Glass beaker", "A sturdy glass beaker.", sid)
    assert [row["task"] for row in rows] == list(DEFAULT_GROUNDING_TEMPLATES)
    eot = end_of_turn_ids(tok)
    assert tok.convert_ids_to_tokens(eot) == ["<|im_end|>"]
    for row in rows:
        n_p = len(row["prompt_ids"])
        assert row["input_ids"] == row["prompt_ids"] + row["answer_ids"]
        assert row["labels"][:n_p] == [IGNORE] * n_p
        assert row["labels"][n_p:] == row["answer_ids"] and row["answer_ids"][-1:] == eot
        assert row["prompt_ids"][-len(r.skeleton.suffix_ids):] == list(r.skeleton.suffix_ids)
        if row["task"].endswith("2sid"):
            assert row["answer_ids"] == sid + eot
            assert not set(sid) & set(row["prompt_ids"])
        else:
            # the SID appears in the question, as exactly the codec's ids, in order
            p = row["prompt_ids"]
            k = p.index(sid[0])
            assert p[k: k + 3] == sid
            assert not set(sid) & set(row["answer_ids"])
    by = {row["task"]: row for row in rows}
    assert tok.decode(by["sid2title"]["answer_ids"][:-1]) == "Glass beaker"
    assert tok.decode(by["sid2desc"]["answer_ids"][:-1]) == "A sturdy glass beaker."
    assert "Which item has the title: Glass beaker?" in tok.decode(by["title2sid"]["prompt_ids"])


def test_prompt_equals_tokenising_the_rendered_chat(tok_range):
    tok, first, _ = tok_range
    r = T.PairRenderer(tok, {"sid2title": DEFAULT_GROUNDING_TEMPLATES["sid2title"],
                             "titledesc2sid": DEFAULT_GROUNDING_TEMPLATES["titledesc2sid"]}, SYS, 256)
    rows = r.render_item("Steel ruler 12 inch", "Metric and imperial marks.", [first, first + 4, first + 8])
    for row, user in zip(rows, [
        "Could you please tell me what item <a_0><b_0><c_0> is called?",
        "What item is called Steel ruler 12 inch and described as Metric and imperial marks.?",
    ]):
        text = tok.apply_chat_template(
            [{"role": "system", "content": SYS}, {"role": "user", "content": user}],
            tokenize=False, add_generation_prompt=True,
        )
        assert row["prompt_ids"] == tok(text, add_special_tokens=False)["input_ids"]


def test_long_text_is_cut_never_the_sid(tok_range):
    tok, first, _ = tok_range
    r = T.PairRenderer(tok, DEFAULT_GROUNDING_TEMPLATES, SYS, max_len=80)
    sid = [first + 3, first + 7, first + 11]
    rows = r.render_item("Beaker " * 30, "glass " * 200, sid)
    for row in rows:
        assert len(row["input_ids"]) <= 80 and row["truncated"]
        assert sid == (row["answer_ids"][:3] if row["task"].endswith("2sid") else
                       row["prompt_ids"][row["prompt_ids"].index(sid[0]):][:3])
    short = r.render_item("Beaker", "glass", sid)
    assert not any(row["truncated"] for row in short)


def test_fit_segments_cuts_longest_first_exactly():
    segs = [([1] * 5, False), ([2] * 20, True), ([3] * 4, True), ([4], False)]
    ids, cut = fit_segments(segs, 20, "x")
    assert cut and sum(map(len, ids)) == 20
    assert ids[0] == [1] * 5 and ids[3] == [4] and ids[2] == [3] * 4 and len(ids[1]) == 10
    with pytest.raises(ConfigError, match="pairs.max_len=5"):
        fit_segments(segs, 5, "x")


def test_markers_wrap_the_sid(tok_range):
    tok, first, end = tok_range
    r = T.PairRenderer(tok, {"title2sid": DEFAULT_GROUNDING_TEMPLATES["title2sid"]}, SYS, 128,
                       sid_wrap=(end - 2, end - 1))
    row = r.render_item("Beaker", "", [first, first + 4, first + 8])[0]
    assert row["answer_ids"][:5] == [end - 2, first, first + 4, first + 8, end - 1]


def test_template_errors_name_the_key(tok_range):
    tok, *_ = tok_range
    with pytest.raises(ConfigError, match="pairs.templates.title2sid"):
        T.PairRenderer(tok, {"title2sid": "Which item is {sid}?"}, SYS, 64)
    with pytest.raises(ConfigError, match="unknown slot"):
        T.PairRenderer(tok, {"sid2title": "Name {sid} by {brand}"}, SYS, 64)


def test_rec_prompt(tok_range):
    tok, first, _ = tok_range
    hist = [[first, first + 4, first + 8], [first + 1, first + 5, first + 9]]
    ids = T.render_rec_prompt(tok, hist, T.REC_TEMPLATES[0], SYS)
    text = tok.apply_chat_template(
        [{"role": "system", "content": SYS},
         {"role": "user", "content": T.REC_TEMPLATES[0].format(history="<a_0><b_0><c_0>, <a_1><b_1><c_1>")}],
        tokenize=False, add_generation_prompt=True,
    )
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    for tmpl in T.REC_TEMPLATES:
        p = T.render_rec_prompt(tok, hist, tmpl, SYS)
        k = p.index(first)
        assert p[k: k + 3] == hist[0]
