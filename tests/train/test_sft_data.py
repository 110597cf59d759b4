"""Tests for gti/train/sft_data.py: leak-free windows, counts, answer-only labels, truncation,
determinism, multitask proportions."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from gti.common.errors import ConfigError, DataError
from gti.lm import templates as T
from gti.train import sft_data as S
from gti.lm.chat import IGNORE
from gti.lm.templates import ROW_COLUMNS, SEQ_TASK

L = 3  # SID length in these tests
EOT = [2]


def _seqs(n_users: int = 30, seed: int = 0) -> pl.DataFrame:
    """Users whose valid/test items are unique to them (v_<u>, t_<u>) and never in any train list."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(n_users):
        n = int(rng.integers(1, 12))
        rows.append(
            {
                "user_id": f"u{u}",
                "train_items": [f"i{int(x)}" for x in rng.integers(0, 40, n)],
                "valid_item": f"v_{u}",
                "test_item": f"t_{u}",
            }
        )
    return pl.DataFrame(rows)


def _sid_ids(items) -> dict[str, np.ndarray]:
    # Distinct fake SID ids per item, in a "new token" range starting at 1000.
    return {it: np.array([1000 + 7 * k + j for j in range(L)]) for k, it in enumerate(sorted(items))}


def _fake_render(tokenizer, history_sid_ids, template, system_prompt):
    """Stand-in for gti.lm.templates.render_rec_prompt: 5 header ids, SIDs joined by a 9."""
    ids = [1, 1, 1, 1, 1]
    for h in history_sid_ids:
        ids += list(h) + [9]
    return ids + [len(template) % 50 + 10]


def _all_items(seqs: pl.DataFrame) -> set[str]:
    out = set(seqs["valid_item"]) | set(seqs["test_item"])
    for t in seqs["train_items"]:
        out |= set(t)
    return out


def test_training_windows_never_contain_valid_or_test_items():
    seqs = _seqs(50)
    w = S.training_windows(seqs, max_history=4, seed=0)
    held_out = set(seqs["valid_item"]) | set(seqs["test_item"])
    assert not held_out & set(w["target"])
    for h in w["history"]:
        assert not held_out & set(h)
    # Each window's history is exactly the (<=4) items before the target in the training list.
    train = dict(zip(seqs["user_id"].to_list(), seqs["train_items"].to_list()))
    for u, pos, h, t in w.select("user_id", "pos", "history", "target").iter_rows():
        assert t == train[u][pos]
        assert list(h) == train[u][max(0, pos - 4) : pos]


def test_training_window_counts():
    seqs = _seqs(40)
    w = S.training_windows(seqs, max_history=3, seed=1)
    expected = sum(max(0, len(t) - 1) for t in seqs["train_items"])
    assert w.height == expected
    assert w["history"].list.len().max() <= 3
    assert w["history"].list.len().min() >= 1
    # users with a single training item contribute nothing
    one = [u for u, t in zip(seqs["user_id"], seqs["train_items"]) if len(t) == 1]
    assert one and not set(one) & set(w["user_id"])


def test_missing_sequence_column_is_named():
    with pytest.raises(DataError, match="valid_item"):
        S.training_windows(pl.DataFrame({"user_id": ["a"], "train_items": [["1"]]}), 3)


def test_templates_rotate_deterministically():
    seqs = _seqs(60)
    a = S.training_windows(seqs, 4, seed=3)["template"].to_list()
    b = S.training_windows(seqs, 4, seed=3)["template"].to_list()
    c = S.training_windows(seqs, 4, seed=4)["template"].to_list()
    assert a == b and a != c
    assert set(a) == {0, 1, 2}


def _renderer(seqs, max_len=200):
    return T.RecRenderer(
        tokenizer=None, sid_ids=_sid_ids(_all_items(seqs)), system_prompt="sys",
        max_len=max_len, eot_ids=EOT, render=_fake_render,
    )


def test_answer_only_labels_and_answer_is_target_sid():
    seqs = _seqs(20)
    r = _renderer(seqs)
    w = S.training_windows(seqs, 4, seed=0)
    rows = r.render_windows(w.to_dict(as_series=False))
    for ids, labels, ans, tgt in zip(rows["input_ids"], rows["labels"], rows["answer_ids"], w["target"]):
        n = len(ans)
        assert ans == r.sid_ids[tgt].tolist() + EOT
        assert ids[-n:] == ans and labels[-n:] == ans
        assert all(x == IGNORE for x in labels[:-n])
        assert len(ids) == len(labels)
    frame = S.rows_frame(rows)
    assert frame.schema["input_ids"] == pl.List(pl.Int32)
    assert frame.columns == list(ROW_COLUMNS)


def test_truncation_drops_oldest_history_first():
    seqs = pl.DataFrame(
        {"user_id": ["a"], "train_items": [[f"x{i}" for i in range(10)]], "valid_item": ["v"], "test_item": ["t"]}
    )
    # header 5 + 4 per item + 1 template id; answer 3 + 1 -> 26 fits 4 history items exactly.
    r = _renderer(seqs, max_len=5 + 4 * 4 + 1 + 4)
    ex = r.example([f"x{i}" for i in range(9)], "x9", 0)
    assert ex["history_kept"] == 4
    assert len(ex["input_ids"]) <= r.max_len
    # the newest 4 items are the ones kept, oldest first
    kept = [r.sid_ids[f"x{i}"].tolist() for i in range(5, 9)]
    assert ex["prompt_ids"][5:-1] == sum(([*k, 9] for k in kept), [])
    too_small = _renderer(seqs, max_len=8)
    with pytest.raises(ConfigError, match="sft.max_len"):
        too_small.example(["x0", "x1"], "x2", 0)


def test_unknown_item_is_named():
    seqs = _seqs(5)
    w = S.training_windows(seqs, 3)
    ids = _sid_ids(_all_items(seqs))
    victim = w["target"][0]
    ids.pop(victim)
    with pytest.raises(DataError, match=f"'{victim}'"):
        S.check_items_known(w, ids, "sequences.parquet")


def _pairs(n: int) -> pl.DataFrame:
    rows = []
    for i in range(n):
        ln = 6 if i % 5 else 400  # every 5th pair is too long for max_len 100
        rows.append(
            {"item_id": f"i{i}", "task": "title2sid" if i % 2 else "sid2title", "split": "train" if i % 7 else "val",
             "input_ids": [i] * ln, "labels": [-100] * (ln - 2) + [i, i], "prompt_ids": [i] * (ln - 2), "answer_ids": [i, i]}
        )
    return pl.DataFrame(rows, schema_overrides={c: pl.List(pl.Int32) for c in ("input_ids", "labels", "prompt_ids", "answer_ids")})


def test_multitask_proportions_and_determinism():
    seqs = _seqs(40)
    r = _renderer(seqs)
    seq_rows = S.rows_frame(r.render_windows(S.training_windows(seqs, 4).to_dict(as_series=False)))
    pairs = _pairs(50)
    mixed, st = S.multitask_mix(seq_rows, pairs, weight=0.5, seed=0, max_len=100)
    assert st.n_sequence == seq_rows.height
    assert st.n_pairs_used == round(0.5 * seq_rows.height)
    assert mixed.height == st.n_sequence + st.n_pairs_used
    assert st.tasks[SEQ_TASK] == seq_rows.height
    # only train-split pairs that fit are used; the too-long ones are counted, not hidden
    train = pairs.filter(pl.col("split") == "train")
    assert st.n_pairs_available == train.height
    assert st.n_pairs_too_long == train.filter(pl.col("input_ids").list.len() > 100).height
    used = mixed.filter(pl.col("task") != SEQ_TASK)
    assert used["input_ids"].list.len().max() <= 100
    val_ids = set(pairs.filter(pl.col("split") == "val")["input_ids"].list.first())
    assert not val_ids & set(used["input_ids"].list.first())
    again, _ = S.multitask_mix(seq_rows, pairs, weight=0.5, seed=0, max_len=100)
    assert again.equals(mixed)
    other, _ = S.multitask_mix(seq_rows, pairs, weight=0.5, seed=1, max_len=100)
    assert not other.equals(mixed)
    # weight > available pairs cycles through them rather than failing
    big, st2 = S.multitask_mix(seq_rows, pairs, weight=3.0, seed=0, max_len=100)
    assert st2.n_pairs_used == round(3.0 * seq_rows.height)
    # weight 0 keeps only the sequence rows (shuffled)
    plain, st3 = S.multitask_mix(seq_rows, pairs, weight=0.0, seed=0, max_len=100)
    assert st3.n_pairs_used == 0 and plain.height == seq_rows.height


def _tiny_tok(markers: bool):
    from gti.lm import models, new_rows
    from gti.sid.codec import SidCodec

    tok = models.build_tiny_tokenizer()
    codec = SidCodec(2, [4, 3])
    new_rows.extend_tokenizer(tok, codec.tokens(), markers=markers)
    codes = np.array([[i // 3, i % 3] for i in range(12)])
    ids = codec.token_ids(codes, tok).numpy()
    return tok, {f"i{k}": ids[k] for k in range(12)}


@pytest.mark.parametrize("markers", [False, True])
def test_make_renderer_with_the_real_templates(markers):
    from gti.lm import templates as T
    from gti.lm.chat import end_of_turn_ids
    from gti.lm.new_rows import SID_END, SID_START

    tok, sid_ids = _tiny_tok(markers)
    r = T.make_renderer(tok, sid_ids, "You are a helpful assistant.", max_len=400)
    eot = end_of_turn_ids(tok)
    ex = r.example(["i1", "i2", "i3"], "i4", 2)
    wrap = [tok.convert_tokens_to_ids(SID_START), tok.convert_tokens_to_ids(SID_END)] if markers else None
    sid4 = sid_ids["i4"].tolist()
    assert ex["answer_ids"] == ([wrap[0], *sid4, wrap[1]] if markers else sid4) + eot
    expected_prompt = T.render_rec_prompt(
        tok, [sid_ids[i].tolist() for i in ("i1", "i2", "i3")], T.REC_TEMPLATES[2],
        "You are a helpful assistant.", **({"sid_wrap": tuple(wrap)} if markers else {}),
    )
    assert ex["prompt_ids"] == expected_prompt
    # The rendered text shows the SIDs verbatim, in order, inside the third template.
    text = tok.decode(ex["input_ids"])
    assert "what to recommend to the user next?" in text
    assert text.index("<a_0><b_1>") < text.index("<a_0><b_2>") < text.index("<a_1><b_0>")
    # Evaluation prompts use the first template and, with markers, end with <sid_start>.
    p, kept = r.prompt(["i1", "i2"])
    assert kept == 2 and "in chronological order" in tok.decode(p)
    assert (p[-1] == wrap[0]) if markers else (p == T.render_rec_prompt(
        tok, [sid_ids["i1"].tolist(), sid_ids["i2"].tolist()], T.REC_TEMPLATES[0], "You are a helpful assistant."))


@pytest.mark.parametrize("markers", [False, True])
def test_compact_prompt_is_history_sids_then_the_assistant_header(markers):
    """`sft.prompt_style: compact`: no system prompt, no template text; the history's SID ids
    (wrapped when the vocabulary has markers), then the assistant header, then the answer."""
    from gti.lm import templates as T
    from gti.lm.chat import chat_skeleton
    from gti.lm.new_rows import SID_END, SID_START

    tok, sid_ids = _tiny_tok(markers)
    chat = T.make_renderer(tok, sid_ids, "You are a helpful assistant.", max_len=400)
    compact = T.make_renderer(tok, sid_ids, "You are a helpful assistant.", max_len=400, prompt_style="compact")
    wrap = [tok.convert_tokens_to_ids(SID_START), tok.convert_tokens_to_ids(SID_END)] if markers else None
    header = list(chat_skeleton(tok, "").suffix_ids)
    hist = []
    for i in ("i1", "i2", "i3"):
        sid = sid_ids[i].tolist()
        hist += [wrap[0], *sid, wrap[1]] if markers else sid
    for k in range(3):  # every template gives the same compact row
        ex = compact.example(["i1", "i2", "i3"], "i4", k)
        assert ex["prompt_ids"] == hist + header
        assert ex["answer_ids"] == chat.example(["i1", "i2", "i3"], "i4", k)["answer_ids"]
        assert ex["labels"] == [-100] * len(ex["prompt_ids"]) + ex["answer_ids"]
    text = tok.decode(compact.example(["i1"], "i4", 0)["input_ids"])
    assert "helpful" not in text and "recommend" not in text
    # Far shorter than the chat row of the same example.
    assert len(compact.example(["i1", "i2", "i3"], "i4", 0)["input_ids"]) < 0.5 * len(
        chat.example(["i1", "i2", "i3"], "i4", 0)["input_ids"])
    # Evaluation prompts follow the same form (ending with <sid_start> under markers).
    p, kept = compact.prompt(["i1", "i2", "i3"])
    assert kept == 3 and p == hist + header + ([wrap[0]] if markers else [])


def test_compact_prompt_truncates_oldest_history_first():
    tok, sid_ids = _tiny_tok(False)
    r = T.make_renderer(tok, sid_ids, "", max_len=12, prompt_style="compact")
    ex = r.example(["i1", "i2", "i3", "i5", "i6"], "i4", 0)
    assert len(ex["input_ids"]) <= 12 and ex["history_kept"] < 5
    kept = ex["history_kept"]
    newest = [x for i in ["i1", "i2", "i3", "i5", "i6"][-kept:] for x in sid_ids[i].tolist()]
    assert ex["prompt_ids"][: len(newest)] == newest


def test_unknown_prompt_style_names_the_key():
    tok, sid_ids = _tiny_tok(False)
    with pytest.raises(ConfigError, match="sft.prompt_style"):
        T.make_renderer(tok, sid_ids, "", max_len=100, prompt_style="terse")


def test_sft_target_counts_agree_with_training_windows():
    seqs = _seqs(60, seed=3)
    counts = S.sft_target_counts(seqs)
    for h in (1, 4):  # the history length does not change which items are targets
        w = S.training_windows(seqs, max_history=h, seed=2)
        vc = w["target"].value_counts()
        assert counts == dict(zip(vc["target"].to_list(), vc["count"].to_list()))
    assert sum(counts.values()) == sum(max(0, len(t) - 1) for t in seqs["train_items"])
    # Valid/test items never count (they are unique to their user and never in train lists).
    held_out = set(seqs["valid_item"]) | set(seqs["test_item"])
    assert not held_out & set(counts)


def test_sft_target_counts_first_items_and_held_out_items_do_not_count():
    seqs = pl.DataFrame({
        "user_id": ["a", "b", "c"],
        "train_items": [["x", "y", "y"], ["y"], []],
        "valid_item": ["x", "z", "z"],
        "test_item": ["z", "x", "y"],
    }, schema={"user_id": pl.Utf8, "train_items": pl.List(pl.Utf8), "valid_item": pl.Utf8, "test_item": pl.Utf8})
    assert S.sft_target_counts(seqs) == {"y": 2}
    with pytest.raises(DataError, match="train_items"):
        S.sft_target_counts(seqs.drop("train_items"))


def test_val_prompt_table_samples_validation_users_with_their_valid_items_row():
    """The SFT and RL stages' validation set: n seeded users, each with the trie row of its valid
    item and the prompt the renderer makes of its history."""
    from gti.train.sft_data import val_prompt_table

    class Renderer:
        def render_prompts(self, w):
            return {"user_id": w["user_id"], "split": w["split"], "target": w["target"],
                    "prompt_ids": [[len(h)] + [int(x[2:]) for x in h] for h in w["history"]]}

    items = [f"it{i}" for i in range(10)]
    seqs = pl.DataFrame({"user_id": [f"u{u}" for u in range(8)],
                         "train_items": [[items[u], items[u + 1]] for u in range(8)],
                         "valid_item": [items[u + 2] for u in range(8)], "test_item": [items[9]] * 8})
    t = val_prompt_table(seqs, Renderer(), items, 5, seed=0, max_history=3)
    assert t.height == 5 and t.columns == ["user_id", "prompt", "target_row"]
    assert t.equals(val_prompt_table(seqs, Renderer(), items, 5, seed=0, max_history=3))
    for u, prompt, row in t.iter_rows():
        k = int(u[1:])
        assert row == k + 2 and prompt == [2, k, k + 1]


@pytest.mark.parametrize("objective", ["window", "sequence"])
def test_time_split_a_marker_planted_in_the_test_period_reaches_no_training_row(objective):
    """data.split=global_time: an item that occurs only in the test period (planted in several
    users' histories there) is in no training row of either objective, no target count, no
    baseline's or SASRec's training data, yet is a test target and in test histories."""
    from gti.data.sequences import build_sequences
    from gti.eval.reference import split_train_sequences
    from gti.eval.sasrec import training_sessions
    from gti.eval.slices import eval_windows

    rng = np.random.default_rng(3)
    rows = []
    for u in range(12):
        for t in sorted(rng.integers(0, 100, size=8).tolist()):
            rows.append((f"u{u}", f"i{rng.integers(0, 15)}", t))
    for u in range(0, 12, 2):  # the marker, twice per user, after everything else
        rows += [(f"u{u}", "MARKER", 200 + u), (f"u{u}", f"i{u}", 201 + u), (f"u{u}", "MARKER", 202 + u)]
    df = pl.DataFrame({"user_id": [r[0] for r in rows], "item_id": [r[1] for r in rows],
                       "ts": [r[2] for r in rows], "order": list(range(len(rows)))})
    seqs = build_sequences(df, 2, None, "global_time", ratios=(6, 2, 2)).sequences
    assert all("MARKER" in t for t in seqs.filter(pl.col("user_id") == "u0")["test_items"].to_list())
    if objective == "window":
        w = S.training_windows(seqs, 4)
        seen = set(w["target"].to_list()) | set(w["history"].explode().drop_nulls().to_list())
    else:
        c = S.training_sequences(seqs, 4)
        seen = set(c["items"].explode().drop_nulls().to_list())
    assert seen and "MARKER" not in seen
    assert "MARKER" not in S.sft_target_counts(seqs)
    assert not any("MARKER" in s for s in split_train_sequences(seqs, "valid"))
    assert not any(r[2] == "MARKER" for r in training_sessions(seqs["train_items"].to_list(),
                                                                 seqs["user_id"].to_list()))
    test = eval_windows(seqs, "test", 4)
    assert "MARKER" in test["target"].to_list() and "MARKER" in test["history"].explode().to_list()
    assert "MARKER" not in eval_windows(seqs, "valid", 4)["history"].explode().to_list()
