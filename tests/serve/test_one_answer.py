"""One request, one answer (issue 51 item 9): `gti recommend` (gti.eval.recommend.top_k),
`gti serve` (RecommenderService.answer, what a replica's app runs) and `gti infer`
(gti.serve.infer.decode_part) take the beam width and the history exclusion from the one
`decode_plan`. Given the same histories and k, the three paths ask the search for the same width
and k and answer the same lists: checked on the searches they ask for (a recording stand-in for
the beam search) and on real decodes of the tiny run of conftest.py with a narrow beam, where
k = 5 plus several distinct history items is wider than eval.beam_width (the case where
`gti recommend` and `gti serve` answered differently)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gti.eval import decode as D
from gti.eval.recommend import decode_plan, top_k
from gti.serve import infer as I
from gti.serve.service import Query, RecommenderService

NARROW = 5  # eval.beam_width for these tests: k=5 + any excluded item widens the search
HISTORIES = [
    ["it3", "it7", "it1", "it9"],  # four distinct items: width 5 + 4 with exclusion
    ["it2", "it2", "it5"],  # a repeated item counts once
    ["it9", "it4", "it11", "it0", "it5", "it6", "it8"],  # longer than max_history (4): the newest 4
    ["it2"],
]


def _narrow(run, width=NARROW):
    """The loaded run with eval.beam_width = `width` (the model and map shared, nothing reloaded)."""
    cfg = run.cfg.model_copy(update={"eval": run.cfg.eval.model_copy(update={"beam_width": width})})
    return dataclasses.replace(run, cfg=cfg)


def _three_paths(run, histories, k, exclude):
    """(gti recommend, gti serve, gti infer) item-id lists for each history."""
    svc = RecommenderService(run, 0, "h", max_k=100)
    rec = [[r["item_id"] for r in top_k(run, h, k, exclude_history=exclude)] for h in histories]
    served = [[r["item_id"] for r in a["items"]] for a in svc.answer([Query(tuple(h), k, exclude) for h in histories])]
    table = I.decode_part(svc, [f"u{i}" for i in range(len(histories))], histories, k=k, exclude_history=exclude,
                          batch_users=3)
    return rec, served, table.column("item_ids").to_pylist()


def test_decode_plan_is_the_rule():
    plan = decode_plan(["a", "b", "a", "c", "d", "e"], 5, exclude_history=True, beam_width=5, max_history=4,
                       catalog_size=100)
    assert plan.used == ("a", "c", "d", "e") and plan.exclude == ("a", "c", "d", "e")
    assert (plan.k, plan.k_decode, plan.width) == (5, 9, 9)
    off = decode_plan(["a", "b"], 5, exclude_history=False, beam_width=20, max_history=4, catalog_size=100)
    assert off.exclude == () and (off.k, off.k_decode, off.width) == (5, 5, 20)
    small = decode_plan(["a", "b"], 5, exclude_history=True, beam_width=2, max_history=4, catalog_size=6)
    assert (small.k, small.k_decode, small.width) == (5, 6, 6)  # the catalog caps what the search returns


@pytest.mark.parametrize("k", [5, 8, 1])
@pytest.mark.parametrize("exclude", [True, False])
def test_the_three_paths_ask_the_search_for_the_same_width(services, monkeypatch, k, exclude):
    """Each path's search, recorded: the same width and k per history (whatever the batching)."""
    run = _narrow(services[0].run)
    asked: list[tuple[int, int]] = []
    real = D.constrained_beam_search

    def recording(model, prompts, *a, **kw):
        asked.extend([(kw["beam_width"], kw["k"])] * len(prompts))
        return real(model, prompts, *a, **kw)

    monkeypatch.setattr(D, "constrained_beam_search", recording)
    per_path = []
    for path in range(3):
        asked.clear()
        if path == 0:
            for h in HISTORIES:
                top_k(run, h, k, exclude_history=exclude)
        elif path == 1:
            RecommenderService(run, 0, "h").answer([Query(tuple(h), k, exclude) for h in HISTORIES])
        else:
            I.decode_part(RecommenderService(run, 0, "h"), list("abcd"), HISTORIES, k=k, exclude_history=exclude,
                          batch_users=4)
        per_path.append(sorted(w for w, _ in asked))
    want = sorted(decode_plan(h, k, exclude_history=exclude, beam_width=NARROW, max_history=run.max_history,
                              catalog_size=len(run.item_ids)).width for h in HISTORIES)
    assert per_path[0] == per_path[1] == per_path[2] == want
    if exclude and k == 5:
        assert want == [6, 7, 9, 9]  # wider than the configured 5: the width follows the excluded items


@pytest.mark.parametrize("k", [5, 8])
def test_the_three_paths_answer_the_same_lists(services, k):
    run = _narrow(services[0].run)
    rec, served, inferred = _three_paths(run, HISTORIES, k, exclude=True)
    assert rec == served == inferred
    for h, items in zip(HISTORIES, rec):
        assert len(items) == k and not set(h[-run.max_history:]) & set(items)
    # Without exclusion too (gti recommend's default, gti infer's default).
    rec, served, inferred = _three_paths(run, HISTORIES, k, exclude=False)
    assert rec == served == inferred


def _cli_recommend(monkeypatch, run, history, k, *flags) -> list[str]:
    """`gti recommend --history ... --k k [flags]` through the CLI's parser and `cli_main`, on
    `run` (LoadedRun.open handed the loaded run: nothing reloaded) -> the item ids it prints."""
    from gti.run import loaded as L
    from gti.cli import main

    shown: list = []
    monkeypatch.setattr(L.LoadedRun, "open", classmethod(lambda cls, *a, **kw: run))
    monkeypatch.setattr("gti.eval.recommend.format_recommendations", lambda recs: shown.append(recs) or "")
    assert main(["recommend", "--run-dir", str(run.run_dir), "--history", ",".join(history), "--k", str(k),
                 *flags]) == 0
    return [r["item_id"] for r in shown[0]]


@pytest.mark.parametrize("k", [5, 8])
def test_gti_recommend_exclude_history_answers_as_gti_serve(services, monkeypatch, k):
    """`gti recommend --exclude-history` (LoadedRun.recommend(exclude_history=True)) lists what
    `gti serve`'s decode answers for the same history and k (it excludes by default); without
    the flag it keeps the history items, as before."""
    run = _narrow(services[0].run)
    served = [[r["item_id"] for r in a["items"]]
              for a in RecommenderService(run, 0, "h", max_k=100).answer([Query(tuple(h), k, True) for h in HISTORIES])]
    kept = []
    for h, want in zip(HISTORIES, served):
        assert [r["item_id"] for r in run.recommend(h, k, exclude_history=True)] == want
        assert _cli_recommend(monkeypatch, run, h, k, "--exclude-history") == want
        kept.append(_cli_recommend(monkeypatch, run, h, k))
        assert kept[-1] == [r["item_id"] for r in top_k(run, h, k)]  # the default: history items kept
    assert any(set(h) & set(items) for h, items in zip(HISTORIES, kept))  # the flag changes a list here


def test_scores_agree_across_paths(services):
    run = _narrow(services[0].run)
    hist = HISTORIES[0]
    ref = top_k(run, hist, 5, exclude_history=True)
    ans = RecommenderService(run, 0, "h").answer([Query(tuple(hist), 5, True)])[0]
    np.testing.assert_allclose([r["score"] for r in ans["items"]], [r["score"] for r in ref], atol=1e-4)
    assert ans["excluded"] == hist


def test_the_width_decides_the_fifth_item(services):
    """Why the width must come from one place: on this model a search of width 5 (max(k, beam
    width), ignoring the excluded items) and one of width 9 (k + 4 excluded) rank a different 5th
    item for the same prompt, as `gti recommend` and `gti serve` did in issue 51."""
    run = services[0].run
    prompt, _ = run.renderer.prompt(HISTORIES[0])

    def rows(width):
        res = D.constrained_beam_search(run.model, [prompt], run.trie, beam_width=width, k=5, levels=run.levels,
                                        pad_id=run.pad_id)
        return res.items[0].tolist()

    narrow, wide = rows(5), rows(9)
    assert narrow[:4] == wide[:4] and narrow[4] != wide[4]
