"""gti/serve/service.py on the tiny run of conftest.py: answers equal `gti recommend`'s code
path (LoadedRun.recommend -> gti.eval.recommend.top_k) for the same history, several requests
are one decode, exclude_history, unknown ids under both policies, k limits, max_history."""

from __future__ import annotations

import numpy as np
import pytest

from gti.run.loaded import LoadedRun
from gti.serve.service import Query, RecommenderService, RequestError, answer_batches

N_ITEMS, N_NEW, MAX_HISTORY = 20, 2, 4  # as tests/serve/conftest.py
HISTORIES = [["it3", "it7", "it1"], ["it2"], ["it9", "it4", "it11", "it0", "it5", "it6", "it8"], ["it2", "it2"]]


def _same(answer_items, expected, atol=1e-4):
    assert [r["item_id"] for r in answer_items] == [r["item_id"] for r in expected]
    assert [r["sid"] for r in answer_items] == [r["sid"] for r in expected]
    assert [r["title"] for r in answer_items] == [r["title"] for r in expected]
    np.testing.assert_allclose([r["score"] for r in answer_items], [r["score"] for r in expected], atol=atol)


@pytest.mark.parametrize("version", [0, 1])
def test_batched_answers_equal_gti_recommend(serve_run, services, version):
    svc = services[version]
    ref = LoadedRun.open(serve_run["run"], version=version)  # what `gti recommend` loads
    answers = svc.recommend(HISTORIES, k=5, exclude_history=False)
    assert len(answers) == len(HISTORIES)
    for hist, ans in zip(HISTORIES, answers):
        _same(ans["items"], ref.recommend(hist, 5))
        assert ans["version"] == version and ans["model"] == ("sft" if version == 0 else "refresh/v1")
    assert answers[0]["map_hash"] == (serve_run["base_hash"] if version == 0 else serve_run["v1_hash"])


def _trie_normalised(run):
    run.cfg = run.cfg.model_copy(update={"eval": run.cfg.eval.model_copy(update={"normalise": "trie"})})
    return run


def test_a_trie_normalised_run_serves_what_recommend_ranks(serve_run):
    """eval.normalise reaches serve and recommend alike: the whole catalog's probabilities sum to 1."""
    svc = RecommenderService.load(serve_run["run"], 0, max_k=100)
    _trie_normalised(svc.run)
    ref = _trie_normalised(LoadedRun.open(serve_run["run"], version=0))
    answers = svc.recommend(HISTORIES[:2], k=N_ITEMS, exclude_history=False)
    for hist, ans in zip(HISTORIES[:2], answers):
        _same(ans["items"], ref.recommend(hist, N_ITEMS))
        assert len(ans["items"]) == N_ITEMS
        np.testing.assert_allclose(np.logaddexp.reduce([r["score"] for r in ans["items"]]), 0.0, atol=1e-4)
    assert svc.info()["decoder"]["normalise"] == "trie" and "catalog children" in svc.info()["decoder"]["scores"]


def test_many_requests_are_one_decode(services, monkeypatch):
    import gti.eval.decode as D

    calls = []
    real = D.constrained_beam_search

    def counting(model, prompts, *a, **kw):
        calls.append((len(prompts), kw["batch_users"]))
        return real(model, prompts, *a, **kw)

    monkeypatch.setattr(D, "constrained_beam_search", counting)
    batches = [[Query(("it1",), 3, False)], [Query(("it2", "it3"), 5, False), Query(("it4",), 2, True)]]
    out = answer_batches(services[0], batches)
    assert calls == [(3, 3)]  # three requests, one search, one prefill batch
    assert [len(b) for b in out] == [1, 2] and [len(a["items"]) for b in out for a in b] == [3, 5, 2]
    assert {a["batch_requests"] for b in out for a in b} == {2}  # two requests shared the decode


def test_search_by_title_or_id(services):
    svc = services[1]
    hits = svc.search("title of it1", 5)
    # "it1" then "it10".."it13" (titles starting with the text, catalog order), cut at 5
    assert [h["item_id"] for h in hits] == ["it1", "it10", "it11", "it12", "it13"]
    assert set(hits[0]) == {"item_id", "title", "sid"} and hits[0]["title"] == "Title of it1"
    assert [h["item_id"] for h in svc.search("NEW", 10)] == ["new0", "new1"]  # case-insensitive, by id
    assert svc.search("no such thing", 10) == [] and len(svc.search("", 3)) == 3
    assert [h["item_id"] for h in svc.search("IT13", 2)] == ["it13"]  # the item with that id first


def test_exclude_history_drops_the_history_items(services):
    svc = services[0]
    hist = ["it3", "it7", "it1"]
    full = svc.run.recommend(hist, 5 + 3)
    ans = svc.recommend([hist], k=5, exclude_history=True)[0]
    assert [r["item_id"] for r in ans["items"]] == [r["item_id"] for r in full if r["item_id"] not in hist][:5]
    assert not set(hist) & {r["item_id"] for r in ans["items"]} and ans["excluded"] == hist


def test_unknown_items_ignored_and_reported_or_refused(serve_run, services):
    ans = services[0].recommend([["it1", "nope", "new0"]], k=3, exclude_history=False)[0]
    assert ans["unknown_items"] == ["nope", "new0"] and ans["history_used"] == 1
    _same(ans["items"], services[0].run.recommend(["it1"], 3))
    strict = RecommenderService(services[0].run, 0, "h", unknown_items="error")
    with pytest.raises(RequestError, match="unknown item id.*nope, zzz") as err:
        strict.recommend([["it1", "nope", "zzz", "nope"]], k=3)
    assert err.value.status == 422 and err.value.extra["unknown_items"] == ["nope", "zzz"]
    # v1 knows the new items.
    assert services[1].recommend([["new0"]], k=3)[0]["unknown_items"] == []


@pytest.mark.parametrize("k, match", [(0, "k must be an integer >= 1"), (N_ITEMS + 1, "catalog size"),
                                      (True, "k must be an integer")])
def test_bad_k_is_422(services, k, match):
    with pytest.raises(RequestError, match=match) as err:
        services[0].recommend([["it1"]], k=k)
    assert err.value.status == 422


def test_k_over_the_limit_and_empty_history(services):
    limited = RecommenderService(services[0].run, 0, "h", max_k=4)
    with pytest.raises(RequestError, match="exceeds the limit of 4"):
        limited.recommend([["it1"]], k=5)
    with pytest.raises(RequestError, match="history is empty"):
        services[0].recommend([[" ", ""]], k=3)
    with pytest.raises(RequestError, match="no item of the history is in the catalog"):
        services[0].recommend([["x", "y"]], k=3)
    # k = the whole catalog is allowed: every item, ranked.
    assert len(services[1].recommend([["it1"]], k=N_ITEMS + N_NEW, exclude_history=False)[0]["items"]) \
        == N_ITEMS + N_NEW


def test_long_history_is_cut_to_the_newest(services):
    hist = [f"it{i}" for i in range(MAX_HISTORY + 3)]
    ans = services[0].recommend([hist], k=3, exclude_history=False)[0]
    assert ans["truncated"] is True and ans["history_used"] == MAX_HISTORY and ans["history_given"] == len(hist)
    _same(ans["items"], services[0].run.recommend(hist[-MAX_HISTORY:], 3))
    short = services[0].recommend([hist[:2]], k=3)[0]
    assert short["truncated"] is False and short["history_used"] == 2


def test_answer_keeps_errors_per_query(services):
    out = services[0].answer([Query(("it1",), 2, False), Query((), 2, False), Query(("it2",), 0, False)])
    assert len(out[0]["items"]) == 2
    assert isinstance(out[1], RequestError) and "empty" in out[1].message
    assert isinstance(out[2], RequestError) and out[2].body()["status"] == 422


def test_info_reports_the_loaded_run(serve_run, services):
    info = services[1].info()
    assert info["version"] == 1 and info["map_hash"] == serve_run["v1_hash"]
    assert info["catalog_size"] == N_ITEMS + N_NEW and info["levels"] == 2
    assert info["decoder"]["beam_width"] == 20 and info["decoder"]["max_history"] == MAX_HISTORY


def test_trust_remote_code_never_comes_from_the_run_folder(serve_run, tmp_path, monkeypatch):
    """A run whose config says trust_remote_code: true is loaded with it off."""
    import shutil

    import gti.run.loaded as LR
    from gti import config as C

    run = tmp_path / "run"
    shutil.copytree(serve_run["run"], run)
    (run / "config.yaml").write_text(C.dump(C.load(None, ["model.trust_remote_code=true"])))
    seen = []
    real = LR.LoadedRun._load.__func__

    def spy(cls, model_dir, sid_map_path, sid_facts, cfg, device, **where):
        seen.append(cfg.model.trust_remote_code)
        return real(cls, model_dir, sid_map_path, sid_facts, cfg, device, **where)

    monkeypatch.setattr(LR.LoadedRun, "_load", classmethod(spy))
    RecommenderService.load(run, 0)
    assert seen == [False]


def test_the_core_imports_neither_ray_nor_fastapi():
    """service.py and reload.py are the pure core: the app adds FastAPI, the deployment Ray."""
    import ast
    from pathlib import Path

    import gti.serve

    pkg = Path(gti.serve.__file__).parent
    for name in ("service.py", "reload.py", "__init__.py"):
        mods = set()
        for node in ast.walk(ast.parse((pkg / name).read_text())):
            if isinstance(node, ast.Import):
                mods |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods.add(node.module.split(".")[0])
        assert not mods & {"ray", "fastapi", "starlette"}, (name, mods)


def test_exclusion_covers_the_history_in_use_only(services):
    """Exclusion is bounded: only the newest max_history items (those in the prompt) are left out."""
    hist = [f"it{i}" for i in range(MAX_HISTORY + 2)]
    ans = services[0].recommend([hist], k=N_ITEMS - MAX_HISTORY, exclude_history=True)[0]
    assert ans["excluded"] == hist[-MAX_HISTORY:]
    got = {r["item_id"] for r in ans["items"]}
    assert not got & set(hist[-MAX_HISTORY:]) and len(got) == N_ITEMS - MAX_HISTORY
