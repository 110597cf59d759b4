"""The pure parts of grounding new vocabulary (gti/lm/described_tokens.py): token files, pairs,
initial rows, description -> token ranks."""

from __future__ import annotations

import json

import pytest
import torch

from gti.common.errors import ConfigError, DataError
from gti.lm import described_tokens, models, new_rows


@pytest.fixture
def tiny(tiny_model_cfg):
    model, tok = models.build_tiny(tiny_model_cfg(tiny_tied=False))
    return model, tok


TOKS = [{"token": "<t_a>", "descriptions": ["glass beaker", "steel flask"], "eval_descriptions": ["a tube"]},
        {"token": "<t_b>", "descriptions": ["rubber gloves"]}]


def test_read_tokens_jsonl_and_yaml(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(t) for t in TOKS) + "\n\n")
    got = described_tokens.read_tokens(p)
    assert [t.token for t in got] == ["<t_a>", "<t_b>"]
    assert got[0].descriptions == ("glass beaker", "steel flask") and got[0].eval_descriptions == ("a tube",)
    y = tmp_path / "t.yaml"
    y.write_text("tokens:\n  - token: <t_c>\n    descriptions: one line\n")
    assert described_tokens.read_tokens(y)[0].descriptions == ("one line",)


@pytest.mark.parametrize("line, match", [
    ('{"token": "<x>", "descriptions": []}', "line 2: 'descriptions' must be a non-empty list"),
    ('{"token": "<x>", "descriptions": ["a"], "docs": 1}', "line 2: unknown key 'docs'"),
    ('{"token": "<t_a>", "descriptions": ["a"]}', "line 2: token '<t_a>' appears twice"),
    ('{"token": " <x>", "descriptions": ["a"]}', "line 2: 'token' must be"),
    ('{"token": "<x>", "descriptions": ["a", ""]}', "line 2: 'descriptions' holds an empty"),
    ('{"token": "<x>",', "line 2: not valid JSON"),
])
def test_read_tokens_errors_name_file_and_line(tmp_path, line, match):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(TOKS[0]) + "\n" + line + "\n")
    with pytest.raises(DataError, match=match) as e:
        described_tokens.read_tokens(p)
    assert str(p) in str(e.value)


def test_templates_map_onto_the_pair_renderer():
    got = described_tokens.pair_templates({"desc2token": "What is {description}?", "token2desc": "Explain {token}."})
    assert got == {"desc2sid": "What is {description}?", "sid2desc": "Explain {sid}."}
    with pytest.raises(ConfigError, match="unknown task 'title2token'"):
        described_tokens.pair_templates({"title2token": "x {description}"})
    with pytest.raises(ConfigError, match="slots only"):
        described_tokens.pair_templates({"desc2token": "x {title} {description}"})


def test_render_pairs_answer_only_labels_and_one_id_per_token(tiny):
    _, tok = tiny
    toks = described_tokens.parse_tokens(TOKS)
    first, end = new_rows.extend_tokenizer(tok, [t.token for t in toks])
    pairs = described_tokens.render_pairs(tok, toks, [first, first + 1])
    # (2 + 1 + 1 descriptions) x 2 directions
    assert len(pairs["task"]) == 8
    assert pairs["split"].count("val") == 2
    for task, ids, labels, prompt, answer, t in zip(pairs["task"], pairs["input_ids"], pairs["labels"],
                                                   pairs["prompt_ids"], pairs["answer_ids"], pairs["item_id"]):
        tid = first if t == "<t_a>" else first + 1
        assert ids == prompt + answer
        assert labels == [-100] * len(prompt) + answer
        if task == "desc2token":
            assert answer[0] == tid and tid not in prompt
        else:
            assert tid in prompt and tid not in answer
    p, tgt = described_tokens.description_prompts(pairs, {"<t_a>": first, "<t_b>": first + 1}, "val")
    assert tgt == [first] and len(p) == 1


@pytest.mark.parametrize("method", ["mean", "mean_noise", "random", "description"])
def test_initial_rows_every_method_untied(tiny, method):
    model, tok = tiny
    n_real = len(tok)
    descs = [[tok.encode("glass beaker"), tok.encode("steel")], [tok.encode("gloves")]]
    rows = described_tokens.initial_rows(method, model, n_real, 2, description_ids=descs, seed=3)
    assert set(rows) == {"e_new", "head_new"}
    assert rows["e_new"].shape == (2, model.config.hidden_size)
    if method == "description":
        old = new_rows.old_rows(model, n_real)
        ids_a = descs[0][0] + descs[0][1]
        assert torch.allclose(rows["e_new"][0], old[ids_a].mean(0), atol=1e-6)  # token-weighted
        assert torch.allclose(rows["e_new"][1], old[descs[1][0]].mean(0), atol=1e-6)
    with pytest.raises(ConfigError, match="codebook"):
        described_tokens.initial_rows("codebook", model, n_real, 2)


def test_description_ranks_and_summary(tiny):
    model, tok = tiny
    first = len(tok)
    new_rows.extend_tokenizer(tok, ["<t_a>", "<t_b>", "<t_c>"])
    d = model.config.hidden_size
    # Zero head rows: every new token scores logit 0 after any prompt.
    init = torch.zeros(3, d)
    new_rows.attach_new_rows(model, first, 3, init, init.clone())
    new_rows.merge_new_rows(model)
    h = model.lm_head.weight
    prompts = [tok.encode("glass beaker"), tok.encode("steel flask tube")]
    ranks = described_tokens.description_ranks(model, prompts, [first, first + 1], [first, first + 1, first + 2],
                                               pad_id=tok.pad_token_id)
    # all three new tokens tie at logit 0: ties count against the target
    assert ranks.tolist() == [3, 3]
    s = described_tokens.rank_summary(ranks, 3)
    assert s["top1"] == 0.0 and s["top3"] == 1.0 and s["chance_top1"] == pytest.approx(1 / 3)
    assert s["chance_mrr"] == pytest.approx((1 + 1 / 2 + 1 / 3) / 3)
    # padding does not change a prompt's score: batch of two == one at a time
    with torch.no_grad():
        h[first + 1] = torch.randn(d)
    both = described_tokens.description_ranks(model, prompts, [first + 1, first + 1], [first, first + 1, first + 2],
                                              pad_id=tok.pad_token_id)
    one = [int(described_tokens.description_ranks(model, [p], [first + 1], [first, first + 1, first + 2])[0])
           for p in prompts]
    assert both.tolist() == one
