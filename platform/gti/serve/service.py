"""One loaded run answering recommendation requests, many histories in one decode.

What it is for: `RecommenderService.load(run_dir, version)` holds ONE loaded run
(`gti.run.loaded.LoadedRun`; which model and map is `gti.run.versions.resolve`'s answer, the map
checked against the model there) with the version that answers. `answer(queries)` checks every
query against this run's catalog and decodes the valid ones together in batched
`constrained_beam_search` calls, within a memory budget in cache tokens (`decode_tokens`,
`pack`, `replica_decode_budget`). Prompt, beam width, history exclusion and scores are those of
`gti recommend` (`gti.eval.recommend.decode_plan` / `answer_items`), so an answer equals
`top_k(run, history, k, exclude_history=...)` for the same history.

What it does NOT know: HTTP, tokens, reloading (gti.serve.reload), or Ray.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

from gti.common.errors import GtiError
from gti.eval.recommend import MAX_K, DecodePlan, answer_items, decode_plan

UnknownPolicy = Literal["ignore", "error"]


class RequestError(GtiError):
    """A request the client must change: `status` (4xx) and a one-line message."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra

    def body(self) -> dict[str, Any]:
        return {"error": self.message, "status": self.status, **self.extra}


@dataclass(frozen=True)
class Query:
    """One history (item ids, oldest first), how many items, whether to leave the history's
    own items out, and what to do with unknown ids (None: the service's policy)."""

    history: tuple[str, ...]
    k: int = 10
    exclude_history: bool = True
    unknown_items: UnknownPolicy | None = None


@dataclass
class Prepared:
    """A query checked against the catalog and its `DecodePlan` (the known items used, the
    newest `max_history`; the items excluded; the search's k and width)."""

    query: Query
    plan: DecodePlan
    given: int
    unknown: list[str] = field(default_factory=list)
    truncated: bool = False

    @property
    def used(self) -> list[str]:
        return list(self.plan.used)

    @property
    def exclude(self) -> list[str]:
        return list(self.plan.exclude)

    @property
    def k_decode(self) -> int:
        return self.plan.k_decode


def decode_tokens(histories: int, width: int, prompt_tokens: int, levels: int) -> int:
    """Key/value-cache tokens one decode holds: every history's left-padded prompt plus the SID
    tokens the search appends, once per beam."""
    return int(histories) * int(width) * (int(prompt_tokens) + int(levels))


def pack(lengths: Sequence[int], width: int, levels: int, budget: int | None) -> list[list[int]]:
    """Consecutive runs of the indexes of prompts of `lengths` tokens, each run's
    `decode_tokens` (at its longest prompt) within `budget` (None: one run). A prompt over the
    budget alone is a run of its own (the caller refuses it before)."""
    runs: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if runs and (budget is None or decode_tokens(len(runs[-1]) + 1, width, max(longest, n), levels) <= budget):
            runs[-1].append(i)
            longest = max(longest, n)
        else:
            runs.append([i])
            longest = n
    return runs


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of keys and values one token takes in `model`'s cache: 2 x layers x key/value heads
    x head dim x the weights' dtype size (what `DynamicCache` stores)."""
    c = model.config
    heads = int(getattr(c, "num_attention_heads"))
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    dtype_bytes = next(model.parameters()).element_size()
    return 2 * int(c.num_hidden_layers) * kv_heads * head_dim * dtype_bytes


def device_memory_bytes(device: Any) -> int:
    """The memory of `device`: a GPU's total, else the machine's physical RAM."""
    import os

    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def replica_decode_budget(run: Any, cfg: Any) -> int:
    """`serve.decode_budget_tokens` of `cfg` (a ServeConfig), or its default for `run`'s model
    on its device (`ServeConfig.decode_budget_for`)."""
    if cfg.decode_budget_tokens is not None:
        return int(cfg.decode_budget_tokens)
    device = next(run.model.parameters()).device
    return cfg.decode_budget_for(kv_bytes_per_token(run.model), device_memory_bytes(device), device.type)


def _shown(ids: Sequence[str], n: int = 10) -> str:
    return ", ".join(ids[:n]) + (f" (+{len(ids) - n} more)" if len(ids) > n else "")


class RecommenderService:
    """A loaded run and the version that answers (`version`: 0 = the run's own stages, k =
    `gti refresh` v<k>; `map_hash`).

    An answer: {"items": [{"item_id", "title", "score", "sid"}] best first (len <= k),
    "history_used": n items in the prompt, "history_given": n, "truncated": bool,
    "unknown_items": [ids dropped], "excluded": [ids left out], **identity} where identity is
    {"version": k, "model": "sft" | "refresh/v<k>", "map_hash": str}: model and map always come
    from the same loaded run, so one version names both.
    """

    def __init__(self, run: Any, version: int, map_hash: str, *, unknown_items: UnknownPolicy = "ignore",
                 max_k: int = MAX_K, decode_budget: int | None = None) -> None:
        self.run, self.version, self.map_hash = run, int(version), str(map_hash)
        self.unknown_items, self.max_k = unknown_items, min(int(max_k), MAX_K)
        self.decode_budget = decode_budget  # tokens per decode (`decode_tokens`); None: unbounded
        # what ran: GET /info, the replica's stats; "sizes": {histories in one decode: decodes}
        self.decodes: dict[str, Any] = {"decodes": 0, "peak_tokens": 0, "sizes": {}}
        self._index: Any = None  # gti.serve.search.CatalogIndex, built at the first search
        self._index_lock = threading.Lock()

    @classmethod
    def load(cls, run_dir: str | Path, version: int | None = None, *, device: str | None = None,
             trust_remote_code: bool = False, **policy: Any) -> "RecommenderService":
        """Load `run_dir` at refresh version `version` (None: the newest, 0: the run's own
        stages) with the existing loader; `trust_remote_code` never comes from the run folder."""
        from gti.run.loaded import LoadedRun

        run = LoadedRun.open(run_dir, device=device, version=version, trust_remote_code=trust_remote_code)
        return cls(run, run.resolved.k, run.resolved.map_hash, **policy)

    # ------------------------------------------------------------------ facts
    @property
    def identity(self) -> dict[str, Any]:
        return {"version": self.version, "model": self.run.model_stage or str(self.run.model_dir),
                "map_hash": self.map_hash}

    @property
    def catalog_size(self) -> int:
        return len(self.run.item_ids)

    def info(self) -> dict[str, Any]:
        """What `GET /info` reports about the loaded run."""
        run = self.run
        return {**self.identity, "model_dir": str(run.model_dir), "run_dir": str(run.run_dir),
                "catalog_size": self.catalog_size, "levels": run.levels,
                "decoder": {"beam_width": run.beam_width, "constrained": True, "normalise": run.normalise,
                            "max_history": run.max_history, "max_len": run.cfg.sft.max_len, "max_k": self.max_k,
                            "decode_budget_tokens": self.decode_budget, "largest_history_tokens": self.worst_case(),
                            **self.decodes,
                            "scores": "sum of the SID tokens' log-probs ("
                                      + ("full-vocabulary log-softmax)" if run.normalise == "vocab"
                                         else "log-softmax over each prefix's catalog children)")}}

    def worst_case(self) -> int:
        """`decode_tokens` of the largest single history a request may send: k = max_k with the
        newest max_history items excluded (the widest beam), a prompt of sft.max_len tokens."""
        run = self.run
        width = max(min(self.max_k + run.max_history, self.catalog_size), run.beam_width)
        return decode_tokens(1, width, run.cfg.sft.max_len, run.levels)

    def search(self, text: str, limit: int) -> list[dict[str, Any]]:
        """Up to `limit` catalog items whose title or id contains `text` (case-insensitive):
        the item with that id first, then titles starting with it, then catalog order
        (`gti.serve.search`: a compact index, no sort of every hit)."""
        from gti.serve.search import CatalogIndex

        run = self.run
        with self._index_lock:  # built once per loaded run (titles do not change under it), by one thread
            if self._index is None:
                self._index = CatalogIndex.build(run.item_ids, run.titles)
        return [{"item_id": run.item_ids[row], "title": run.titles.get(run.item_ids[row], ""), "sid": run.sids[row]}
                for row in self._index.search(text, limit)]

    # ------------------------------------------------------------------ requests
    def prepare(self, query: Query) -> Prepared:
        """`query` checked against this catalog; RequestError (422) naming what is wrong."""
        k = query.k
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise RequestError(422, f"k must be an integer >= 1, got {k!r}")
        if k > self.max_k:
            raise RequestError(422, f"k={k} exceeds the limit of {self.max_k} (serve.max_k)")
        if k > self.catalog_size:
            raise RequestError(422, f"k={k} exceeds the catalog size ({self.catalog_size} items)")
        history = [str(h).strip() for h in query.history if str(h).strip()]
        if not history:
            raise RequestError(422, "history is empty: give at least one item id")
        known_ids = self.run.sid_ids
        unknown = [h for h in dict.fromkeys(history) if h not in known_ids]
        if unknown and (query.unknown_items or self.unknown_items) == "error":
            raise RequestError(422, f"unknown item id(s) in history: {_shown(unknown)}", unknown_items=unknown)
        known = [h for h in history if h in known_ids]
        if not known:
            raise RequestError(422, f"no item of the history is in the catalog (unknown: {_shown(unknown)})",
                               unknown_items=unknown)
        run = self.run
        plan = decode_plan(known, k, exclude_history=query.exclude_history, beam_width=run.beam_width,
                           max_history=run.max_history, catalog_size=self.catalog_size)
        return Prepared(query=query, plan=plan, given=len(history), unknown=unknown,
                        truncated=len(known) > run.max_history)

    def answer(self, queries: Sequence[Query]) -> list[dict[str, Any] | RequestError]:
        """Per query an answer dict or its RequestError; the valid ones decoded together, in
        decodes of at most `decode_budget` tokens (`prepare` checks each: empty history, unknown
        ids, k, history longer than `max_history`). Decodes run per beam width, prefill once
        per request, the beams of a request sharing the trie mask. The search repeats each
        prompt's key/value cache once per beam, so consecutive histories are packed into decodes
        within the budget (`pack`), and a history that alone exceeds it gets a 413 naming the
        limit (`serve.decode_budget_tokens`). Answers equal `gti recommend`'s: same top-K, scores
        within fp tolerance (batching left-pads prompts with position ids that count only real
        tokens)."""
        out: list[dict[str, Any] | RequestError] = []
        ready: list[tuple[int, Prepared]] = []
        for i, q in enumerate(queries):
            try:
                ready.append((i, self.prepare(q)))
                out.append({})
            except RequestError as err:
                out.append(err)
        for i, answer in self._decode(ready):
            out[i] = answer
        return out

    def recommend(self, histories: Sequence[Sequence[str]], k: int = 10,
                  exclude_history: bool = True) -> list[dict[str, Any]]:
        """Answers for `histories` (one decode); the first invalid one raises its RequestError."""
        res = self.answer([Query(tuple(h), k, exclude_history) for h in histories])
        for r in res:
            if isinstance(r, RequestError):
                raise r
        return res  # type: ignore[return-value]

    # ------------------------------------------------------------------ decoding
    def _decode(self, ready: list[tuple[int, Prepared]]) -> list[tuple[int, Any]]:
        """`constrained_beam_search` per beam width of the queries' plans (one width when every
        k plus its excluded items fits in the configured width), in as many decodes as the
        budget asks; -> (index, answer or RequestError)."""
        groups: dict[int, list[tuple[int, Prepared]]] = {}
        for i, p in ready:
            groups.setdefault(p.plan.width, []).append((i, p))
        out = []
        for width, group in groups.items():
            out += self._search(width, group)
        return out

    def _too_large(self, width: int, prompt_tokens: int) -> RequestError | None:
        """413 when one history alone needs more than the decode budget (it can never run)."""
        need = decode_tokens(1, width, prompt_tokens, self.run.levels)
        if self.decode_budget is None or need <= self.decode_budget:
            return None
        return RequestError(413, f"this history needs {need:,} decode tokens (beam width {width} x "
                                 f"{prompt_tokens + self.run.levels} prompt and SID tokens), over this replica's "
                                 f"limit of {self.decode_budget:,} (serve.decode_budget_tokens); ask for a smaller k "
                                 "or send fewer history items")

    def _search(self, width: int, group: list[tuple[int, Prepared]]) -> list[tuple[int, Any]]:
        """The group's queries (one beam width) in decodes within the budget (`pack`)."""
        run = self.run
        out: list[tuple[int, Any]] = []
        fits, prompts, kept = [], [], []
        for i, p in group:
            ids, n_kept = run.renderer.prompt(p.used)
            err = self._too_large(width, len(ids))
            if err is not None:
                out.append((i, err))
                continue
            fits.append((i, p))
            prompts.append(ids)
            kept.append(n_kept)
        # The most any query of the group asks for: the others take a prefix of the same
        # sorted beams, which is what a search of their own k would return.
        k_dec = min(max((p.k_decode for _, p in fits), default=1), width)
        for run_idx in pack([len(ids) for ids in prompts], width, run.levels, self.decode_budget):
            out += self._decode_run(width, k_dec, [fits[u] for u in run_idx], [prompts[u] for u in run_idx],
                                    [kept[u] for u in run_idx])
        return out

    def _decode_run(self, width: int, k_dec: int, group: list[tuple[int, Prepared]], prompts: list[list[int]],
                    kept: list[int]) -> list[tuple[int, dict[str, Any]]]:
        """ONE decode of `prompts` (already within the budget: `batch_users` = all of them)."""
        from gti.eval.decode import constrained_beam_search

        run = self.run
        tokens = decode_tokens(len(prompts), width, max(len(ids) for ids in prompts), run.levels)
        self.decodes["decodes"] += 1
        self.decodes["peak_tokens"] = max(self.decodes["peak_tokens"], tokens)
        sizes = self.decodes["sizes"]  # str keys: what JSON makes of them anyway
        sizes[str(len(prompts))] = sizes.get(str(len(prompts)), 0) + 1
        res = constrained_beam_search(run.model, prompts, run.trie, beam_width=width, k=k_dec, levels=run.levels,
                                      pad_id=run.pad_id, constrained=True, normalise=run.normalise,
                                      batch_users=len(prompts))
        out = []
        for u, (i, p) in enumerate(group):
            items = answer_items(run, res.items[u].tolist(), res.scores[u].tolist(), p.plan)
            out.append((i, {"items": items, "history_used": int(kept[u]), "history_given": p.given,
                            "truncated": p.truncated or int(kept[u]) < len(p.used),
                            "unknown_items": p.unknown, "excluded": [x for x in p.exclude], **self.identity}))
        return out


def answer_batches(service: RecommenderService, batches: Sequence[Sequence[Query]]) -> list[list[Any]]:
    """Several requests' queries (a request = a list of queries) answered in ONE `answer`
    call of one service (one version; as many decodes as its budget asks), then split back per
    request: what a replica's `Gatherer` runs. Each answer says how many requests were gathered
    with it (`batch_requests`)."""
    flat = [q for batch in batches for q in batch]
    res = service.answer(flat)
    for r in res:
        if isinstance(r, dict):
            r["batch_requests"] = len(batches)
    out, start = [], 0
    for batch in batches:
        out.append(res[start:start + len(batch)])
        start += len(batch)
    return out
