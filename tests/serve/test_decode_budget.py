"""Bounded decode memory (issue 51 item 1), without Ray: the default budget (a share of the
replica's memory over the model's key/value-cache bytes per token), the packing of histories
into decodes within it, a 413 naming the limit for a history that can never fit, answers equal
whatever the budget, and a replica (the `GtiRecommender` class of gti/serve/deployment.py,
called in-process with Serve's replica context faked) whose every decode, counted at the search
itself under 16 concurrent maximal requests, stays within the budget."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest
from pydantic import ValidationError

from gti.config.serve import ServeConfig, decode_budget
from gti.serve.service import (
    Query, RecommenderService, RequestError, decode_tokens, kv_bytes_per_token, pack, replica_decode_budget,
)

MAX_HISTORY, CATALOG_V1 = 4, 22  # as tests/serve/conftest.py
GIB = 1 << 30


def _history(i: int, n: int = MAX_HISTORY + 2) -> list[str]:
    return [f"it{(i + j) % 20}" for j in range(n)]


def test_the_default_budget_is_a_share_of_the_replicas_memory_over_the_cache_bytes():
    assert decode_budget(46_080, 16 * GIB, 0.25) == 4 * GIB // 46_080  # SmolLM2-135M fp32, 16 GiB
    assert decode_budget(10**12, 1, 0.25) == 1  # never 0: one token, and every history gets a 413
    with pytest.raises(ValueError, match="kv_bytes_per_token must be >= 1"):
        decode_budget(0, GIB, 0.25)
    cpu = ServeConfig()
    assert cpu.decode_budget_for(1024, 8 * GIB, "cpu") == decode_budget(1024, 8 * GIB, 0.25)
    # On CPU the machine's RAM is shared by the replicas (all of them may land on one machine).
    assert ServeConfig(replicas=2).decode_budget_for(1024, 8 * GIB, "cpu") == decode_budget(1024, 4 * GIB, 0.25)
    auto = ServeConfig(min_replicas=1, max_replicas=4)
    assert auto.decode_budget_for(1024, 8 * GIB, "cpu") == decode_budget(1024, 2 * GIB, 0.25)
    # A GPU: its memory, times a fractional GPU share.
    half = ServeConfig(num_gpus=0.5, decode_memory_share=0.5)
    assert half.decode_budget_for(1024, 80 * GIB, "cuda") == decode_budget(1024, 40 * GIB, 0.5)
    assert ServeConfig(decode_budget_tokens=5000).decode_budget_for(1024, 8 * GIB, "cpu") == 5000
    for bad in ({"decode_memory_share": 0}, {"decode_memory_share": 0.95}, {"decode_budget_tokens": 0}):
        with pytest.raises(ValidationError):
            ServeConfig(**bad)


def test_kv_bytes_per_token_and_the_replica_budget(services):
    run = services[1].run
    c = run.model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    expected = 2 * c.num_hidden_layers * (c.num_key_value_heads or c.num_attention_heads) * head_dim * 4  # fp32
    assert kv_bytes_per_token(run.model) == expected
    assert replica_decode_budget(run, ServeConfig(decode_budget_tokens=777)) == 777
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert replica_decode_budget(run, ServeConfig()) == decode_budget(expected, ram, 0.25)


def test_pack_keeps_every_decode_within_the_budget():
    lengths = [90, 104, 92, 104, 100, 95, 104]
    for budget in (2_500, 5_000, 8_000, 20_000):
        runs = pack(lengths, 22, 2, budget)
        assert [i for r in runs for i in r] == list(range(len(lengths)))  # every prompt once, in order
        for r in runs:
            assert decode_tokens(len(r), 22, max(lengths[i] for i in r), 2) <= budget
    assert pack(lengths, 22, 2, None) == [list(range(len(lengths)))]
    assert pack(lengths, 22, 2, 2_000) == [[i] for i in range(len(lengths))]  # over it: alone (refused before)
    assert decode_tokens(3, 22, 104, 2) == 3 * 22 * 106


def test_a_history_that_can_never_fit_is_413_naming_the_limit(services):
    svc = RecommenderService(services[1].run, 1, "h", max_k=100, decode_budget=2_000)
    out = svc.answer([Query(tuple(_history(0)), CATALOG_V1, True), Query(("it1",), 3, False)])
    assert isinstance(out[0], RequestError) and out[0].status == 413
    msg = out[0].message
    assert "over this replica's limit of 2,000 (serve.decode_budget_tokens)" in msg and "\n" not in msg
    assert "beam width 22 x" in msg and "ask for a smaller k" in msg
    ref = services[1].answer([Query(("it1",), 3, False)])[0]
    assert [r["item_id"] for r in out[1]["items"]] == [r["item_id"] for r in ref["items"]]  # the other is answered


def test_answers_do_not_depend_on_the_budget(services):
    queries = [Query(tuple(_history(i, 1 + i % 6)), 5 + i % 3, bool(i % 2)) for i in range(12)]
    free = services[1].answer(queries)
    svc = RecommenderService(services[1].run, 1, "h", max_k=100, decode_budget=5_000)
    tight = svc.answer(queries)
    assert svc.decodes["decodes"] > 2 and svc.decodes["peak_tokens"] <= 5_000
    # each decode's size is counted (GET /info "searches" "sizes": histories in one decode)
    sizes = svc.decodes["sizes"]
    assert sum(sizes.values()) == svc.decodes["decodes"] and sum(int(n) * c for n, c in sizes.items()) == 12
    for a, b in zip(free, tight):
        assert [r["item_id"] for r in a["items"]] == [r["item_id"] for r in b["items"]]
        np.testing.assert_allclose([r["score"] for r in a["items"]], [r["score"] for r in b["items"]], atol=1e-4)


@pytest.fixture
def replica(serve_run, monkeypatch):
    """`make(**serve_settings)` -> a `GtiRecommender` replica object on the tiny run's v1,
    built in this process (Serve's replica context faked; no reload polling)."""
    pytest.importorskip("ray.serve")
    from gti.serve import deployment as D

    ctx = SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda: "gti#gti-recommender#test"))
    monkeypatch.setattr(D.serve, "get_replica_context", lambda: ctx)
    made = []

    def make(**settings):
        cfg = ServeConfig(reload_poll_s=0, **settings).model_dump(mode="json")
        made.append(D.GtiRecommender.func_or_class(str(serve_run["run"]), 1, cfg, None))
        return made[-1]

    yield make
    for rep in made:
        rep.holder.close()


def _forward(rep, path: str, body: dict):
    return rep.forward("POST", path, b"", [(b"content-type", b"application/json")], json.dumps(body).encode())


def test_16_concurrent_maximal_requests_never_exceed_the_decode_budget(replica, monkeypatch):
    """Each request: serve.max_batch_histories histories of more than max_history items (cut to
    the newest max_history) at the largest k, history excluded (the widest beam). Every search
    is counted where it runs (`gti.eval.decode._search_batch`: histories x width x padded
    prompt + SID tokens); before the budget, the 16 requests went into one search of 256."""
    import gti.eval.decode as ED

    budget, per_request = 8_000, 16
    seen: list[tuple[int, int]] = []
    real = ED._search_batch

    def counting(model, prompts, trie, width, k, levels, pad_id, *rest):
        seen.append((len(prompts), decode_tokens(len(prompts), width, max(len(p) for p in prompts), levels)))
        return real(model, prompts, trie, width, k, levels, pad_id, *rest)

    monkeypatch.setattr(ED, "_search_batch", counting)
    rep = replica(max_batch_histories=per_request, max_batch_size=16, batch_wait_timeout_s=0.05,
                  decode_budget_tokens=budget)

    async def main():
        return await asyncio.gather(*(_forward(rep, "/recommend/batch", {
            "histories": [_history(16 * r + i) for i in range(per_request)], "k": CATALOG_V1,
            "exclude_history": True}) for r in range(16)))

    answers = asyncio.run(main())
    assert [status for status, _, _ in answers] == [200] * 16, answers[0][2][:300]
    assert sum(n for n, _ in seen) == 16 * per_request  # every history decoded once
    assert max(tokens for _, tokens in seen) <= budget and len(seen) >= 16
    stats = rep.stats()
    assert stats["requests"] == 16 and stats["largest_batch_histories"] <= 16  # gathered in histories
    assert stats["searches"]["peak_tokens"] == max(tokens for _, tokens in seen) <= stats["searches"]["budget_tokens"]
    first = json.loads(answers[0][2])["results"][0]
    assert first["history_used"] == MAX_HISTORY and first["truncated"] and len(first["items"]) == CATALOG_V1 - 4


def test_small_requests_are_gathered_and_a_too_large_one_is_413(replica):
    rep = replica(max_batch_size=8, batch_wait_timeout_s=0.2, decode_budget_tokens=2_100)

    async def main():
        return await asyncio.gather(*(_forward(rep, "/recommend", {"history": ["it1"], "k": 3}) for _ in range(6)))

    assert [status for status, _, _ in asyncio.run(main())] == [200] * 6
    assert rep.stats()["largest_batch"] > 1  # concurrent single-history requests still share batches
    status, _, body = asyncio.run(_forward(rep, "/recommend/batch", {
        "histories": [["it1"], _history(3)], "k": CATALOG_V1, "exclude_history": True}))
    err = json.loads(body)
    assert status == 413 and err["status"] == 413 and err["error"].startswith("histories[1]: this history needs ")
    assert "(serve.decode_budget_tokens)" in err["error"]
    info = json.loads(asyncio.run(rep.forward("GET", "/info", b"", [], b""))[2])
    assert info["decoder"]["decode_budget_tokens"] == 2_100 and info["decoder"]["largest_history_tokens"] > 2_000
