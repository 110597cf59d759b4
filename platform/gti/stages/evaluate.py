"""Stage `evaluate`: top-K metrics of the run's model by constrained beam search, beside the
reference rows.

What it is for: for the valid and test splits of a seeded user sample, render each held-out
row's history prompt, decode the top K items over the catalog's SID trie in a Ray Data actor
pool (every actor checks the model's SID map first), and score them with bootstrap CIs over
users, beside the reference rows (MostPop, Markov, SASRec tuned on valid) on the same users,
with paired differences, exact ranks and the cold-item slice. Decoded rows are kept in resumable
chunks of the work dir (`chunk_rows`). Outputs and facts: docs/ARCHITECTURE.md.

What it does not know: how the model was trained, how beams are searched (`gti.eval.decode`),
how metrics are defined (`gti.eval.metrics`, `gti.eval.rank`, `gti.eval.slices`).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa

from gti import config as C
from gti.run.chunked_output import ChunkedOutput
from gti.run.contract import StageContext, StageResult
from gti.data.sequences import check_sequences
from gti.common.errors import ConfigError, DataError
from gti.eval.reference import metric_block, paired_differences, paired_k, reference_block, reference_frames
from gti.eval.slices import cold_users, eval_users, n_cold_items, slice_metrics, split_frame
from gti.eval.tables import format_ranks, format_table
from gti.common.files import atomic_write_json
from gti.common.timing import Timer
from gti.train import sft_data

METRICS_FILE = "metrics.json"
RECS_FILE = "recs.parquet"
DECODED_DIR = "decoded"  # resumable chunks of decoded rows (gti.run.chunked_output), in the work dir
CHUNK_ROWS = 256  # prompts per chunk, rounded to a multiple of eval.batch_users
EXACT_RANK_CHUNK_ROWS = 32  # exact ranks cost seconds a prompt on a CPU: a kill loses minutes, not 1/4 h
_on_chunk = None  # test hook: called with each chunk index written (e.g. to interrupt the stage)


# --------------------------------------------------------------------------- the actor
class Recommender:
    """`map_batches` callable class: rows (user_id, split, history, target) -> top-K items.

    Loads the model folder once per actor (fp32 on CPU, bf16 on GPU), refuses a stale SID map,
    and renders prompts itself so the driver never tokenises the user base."""

    def __init__(self, model_dir: str, sid_map_path: str, sid_facts: dict, run_config: dict) -> None:
        import torch

        from gti.run.loaded import LoadedRun

        cfg = C.validate(run_config, "<evaluate worker config>")
        self.ec = cfg.eval
        self.device = torch.device("cuda" if self.ec.num_gpus > 0 and torch.cuda.is_available() else "cpu")
        if self.device.type == "cpu":
            from gti.common.devices import use_cpu_threads

            use_cpu_threads(self.ec.cpu_threads)
        run = LoadedRun.open(model_dir=model_dir, sid_map_path=sid_map_path, sid_facts=sid_facts,
                             cfg=cfg, device=self.device)
        self.model, self.tokenizer, self.pad_id, self.item_ids = run.model, run.tokenizer, run.pad_id, run.item_ids
        self.row_of = {item: r for r, item in enumerate(self.item_ids)}
        # [N, L] SID token ids, row i = item_ids[i]; the trie's rows and score_catalog's columns.
        self.mat, self.levels, self.trie, self.renderer = run.sid_matrix, run.levels, run.trie, run.renderer
        self.k = max(self.ec.ks)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from gti.eval.decode import constrained_beam_search

        cols = {c: batch.column(c).to_pylist() for c in ("user_id", "split", "history", "target")}
        prompts = self.renderer.render_prompts(cols)["prompt_ids"]
        res = constrained_beam_search(
            self.model, prompts, self.trie, beam_width=self.ec.beam_width, k=self.k,
            levels=self.levels, pad_id=self.pad_id, constrained=self.ec.constrained,
            normalise=self.ec.normalise, batch_users=self.ec.batch_users,
        )
        rows, scores = res.items.tolist(), res.scores.float().tolist()
        items = [[self.item_ids[r] for r in row if r >= 0] for row in rows]
        scores = [[s for r, s in zip(row, sc) if r >= 0] for row, sc in zip(rows, scores)]
        # Invalid beams per user are not in DecodeResult; the batch totals go on the first row.
        n = len(rows)
        n_ret, n_inv = [0] * n, [0] * n
        if n:
            n_ret[0], n_inv[0] = res.n_returned, res.n_invalid
        ranks = self.exact_ranks(prompts, cols["target"]) if self.ec.exact_rank else [None] * n
        return pa.table({
            "user_id": cols["user_id"],
            "split": cols["split"],
            "target": cols["target"],
            "items": pa.array(items, type=pa.list_(pa.string())),
            "scores": pa.array(scores, type=pa.list_(pa.float32())),
            "n_returned": pa.array(n_ret, type=pa.int64()),
            "n_invalid": pa.array(n_inv, type=pa.int64()),
            "exact_rank": pa.array(ranks, type=pa.float64()),
        })

    def exact_ranks(self, prompts: list[list[int]], targets: list[str]) -> list[float]:
        """Rank (1 = best, mid-rank on ties) of each target among all catalog items."""
        from gti.eval.rank import exact_ranks, score_catalog

        missing = sorted({t for t in targets if t not in self.row_of})
        if missing:
            raise DataError(f"evaluate: target item(s) {missing[:5]} are not in the SID map")
        if not prompts:
            return []
        scores = score_catalog(
            self.model, prompts, self.mat, pad_id=self.pad_id, batch_users=self.ec.batch_users
        )
        rows = [self.row_of[t] for t in targets]
        return exact_ranks(scores, rows).tolist()


# --------------------------------------------------------------------------- stage entry
def run(ctx: StageContext) -> StageResult:
    ec, timer = ctx.cfg.eval, Timer()
    ks = list(ec.ks)
    with timer.phase("read"):
        inp = _read_inputs(ctx)
    with timer.phase("decode"):
        recs, decode_facts = _decode(ctx, inp)
    with timer.phase("reference"):  # SASRec: tuned on valid and trained once, on the training items
        inp.frames, reference_facts = reference_frames(
            inp.frames, inp.seqs, inp.catalog, ec.baselines, ctx.cfg.data.max_history, ec.sasrec.model_dump(),
            ctx.cfg.seed, max(ks), ec.exact_rank, ctx.log)
    with timer.phase("metrics"):
        out = _metrics(ctx, inp, recs)
    out["reference"] = reference_facts  # the SASRec row's label, settings and sweep, for the summary
    with timer.phase("write"):
        _write_outputs(ctx, out, recs)
    for line in format_table(out, ks).splitlines():
        ctx.log(line)
    for line in format_paired(out):
        ctx.log(line)
    return StageResult(
        outputs={"metrics": METRICS_FILE, "recommendations": RECS_FILE},
        facts={
            "metrics": out["splits"],
            "baselines": out["baselines"],
            "ranks": out["ranks"],
            "baseline_ranks": out["baseline_ranks"],
            **reference_facts,  # sasrec: label, train_seconds, max_len, selection, sweep, ...
            "paired": out["paired"],
            "slices": out["slices"],
            "invalid_sid_rate": out["invalid_sid_rate"],
            "n_users": out["n_users"],
            **decode_facts,  # users_per_s, resumed_prompts
            "sid_map_hash": inp.sid_facts["sid_map_hash"],
            "timing": timer.facts(),
        },
    )


@dataclass
class _Inputs:
    """What the stage reads before decoding: upstream outputs and the sampled users' prompts."""

    model_dir: Path
    sid_map_path: Path
    sid_facts: dict[str, Any]
    catalog: list[str]  # item ids in SID-map row order
    seqs: pl.DataFrame  # ingest's per-user sequences
    frames: dict[str, pl.DataFrame]  # split -> the sampled users' windows (history, target)
    rows: pl.DataFrame  # every split's frame, in decoding order
    sft_counts: dict[str, int]  # item -> SFT training windows targeting it (the cold slice)
    n_cold: int  # catalog items that are cold under that definition


def _read_inputs(ctx: StageContext) -> _Inputs:
    """Refuse a stale SID map or a K above the catalog, read the sequences, sample the users."""
    from gti.run.versions import check_model_map

    cfg, ec = ctx.cfg, ctx.cfg.eval
    sid_facts = ctx.manifest("sid").facts
    # The run's model: RL's export when the rl stage trained, else SFT's.
    model_dir, sid_map_path = ctx.input("rl" if cfg.rl.trains else "sft", "model"), ctx.input("sid", "sid_map")
    # Refuse a stale SID map before starting anything (a descendant of the model's is accepted).
    check_model_map(model_dir, sid_facts["sid_map_hash"], map_path=sid_map_path)
    catalog = pl.read_parquet(sid_map_path, columns=["item_id"])["item_id"].to_list()
    if max(ec.ks) > len(catalog):
        raise ConfigError(f"eval.ks {ec.ks}: K={max(ec.ks)} exceeds the catalog of {len(catalog)} items")
    seq_path = ctx.input("ingest", "sequences")
    seqs = pl.read_parquet(seq_path)
    check_sequences(seqs, str(seq_path))
    # A fixed sample seed (eval.sample_seed) keeps the same users across the seeds of a
    # comparison, so per-user metrics pair up; None samples with the run's seed.
    users = eval_users(seqs, ec.max_users, cfg.seed if ec.sample_seed is None else ec.sample_seed)
    frames = {s: split_frame(seqs, s, users, cfg.data.max_history) for s in ec.splits}
    rows = pl.concat([frames[s] for s in ec.splits])
    ctx.log(
        f"{len(users):,} users x splits {list(ec.splits)}: beam {ec.beam_width}, K {ec.ks}, "
        f"{'constrained' if ec.constrained else 'UNCONSTRAINED'} ({ec.normalise}-normalised), "
        f"{ec.concurrency} actor(s), "
        f"{ec.num_gpus} GPU(s) each{', exact ranks over the catalog' if ec.exact_rank else ''}"
    )
    # Cold items: counted on SFT training windows only (train items; never valid/test).
    sft_counts = sft_data.sft_target_counts(seqs)
    n_cold = n_cold_items(catalog, sft_counts, ec.cold_max_sft_targets)
    return _Inputs(model_dir, sid_map_path, sid_facts, catalog, seqs, frames, rows, sft_counts, n_cold)


def chunk_rows(ec) -> int:
    """Prompts per resumable chunk: whole `eval.batch_users` batches, so a resumed run decodes the
    same batches (beam search is exact per batch) and gives an uninterrupted run's metrics;
    fewer with `eval.exact_rank` (slow prompts)."""
    target = EXACT_RANK_CHUNK_ROWS if ec.exact_rank else CHUNK_ROWS
    return ec.batch_users * max(1, round(target / ec.batch_users))


def _decode(ctx: StageContext, inp: _Inputs) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Decode every prompt not already in a chunk of an interrupted attempt; -> (the decoded
    rows of all prompts, in `inp.rows` order; {users_per_s, resumed_prompts})."""
    rows, ec = inp.rows, ctx.cfg.eval
    decoded = ChunkedOutput(ctx.work_dir / DECODED_DIR, rows.select("user_id", "split").to_arrow(), chunk_rows(ec),
                            on_chunk=_on_chunk)
    resumed = decoded.resume()
    if resumed:
        ctx.log(f"resuming: {resumed:,} of {rows.height:,} prompts already decoded by an interrupted attempt")
    todo = rows.slice(resumed)
    blocks = _recommendation_blocks(ctx, inp, todo) if todo.height else []
    from gti.common.progress import Progress

    bar = Progress(todo.height, "decode", "prompts", log=ctx.log)  # a resumed run decodes only the rest
    t0 = time.time()
    parts = decoded  # parts.append writes each whole chunk; iterating gives them all
    for block in blocks:
        block = block if isinstance(block, pa.Table) else pa.Table.from_batches([block])
        parts.append(block)
        bar.update(block.num_rows)
    bar.close()
    recs = pl.from_arrow(pa.concat_tables(parts)) if parts else None
    if recs is None or recs.height != rows.height:
        raise DataError(f"evaluate: decoded {0 if recs is None else recs.height} of {rows.height} prompts")
    elapsed = time.time() - t0
    ctx.log(f"decoded {todo.height:,} prompts in {elapsed:.1f}s ({todo.height / max(elapsed, 1e-9):.2f} users/s)"
            + (f", {resumed:,} more from the interrupted attempt" if resumed else ""))
    return recs, {"users_per_s": round(todo.height / max(elapsed, 1e-9), 3), "resumed_prompts": resumed}


def _recommendation_blocks(ctx: StageContext, inp: _Inputs, todo: pl.DataFrame):
    """`todo` decoded by `Recommender`, `eval.batch_users` prompts a call, in order (pyarrow
    tables): on a Ray Data actor pool, or in this process for a catalog of at most
    `local_max_items` items and one CPU actor (the same batches and threads: the same top-K)."""
    cfg, ec = ctx.cfg, ctx.cfg.eval
    kwargs = dict(model_dir=str(inp.model_dir), sid_map_path=str(inp.sid_map_path), sid_facts=inp.sid_facts,
                  run_config=cfg.model_dump(mode="json"))
    if len(inp.catalog) <= cfg.local_max_items and ec.concurrency == 1 and not ec.num_gpus:
        ctx.log(f"{len(inp.catalog):,} items <= local_max_items: decoded in this process")
        return _local_blocks(kwargs, todo.to_arrow(), ec.batch_users)
    import ray

    from gti.ray_start import ensure_ray

    ensure_ray(cfg)
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    return ray.data.from_arrow(todo.to_arrow()).map_batches(
        Recommender, fn_constructor_kwargs=kwargs, batch_size=ec.batch_users, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=ec.concurrency), num_gpus=ec.num_gpus or None,
    ).iter_batches(batch_size=None, batch_format="pyarrow")


def _local_blocks(kwargs: dict, table: pa.Table, batch: int):
    """`Recommender(**kwargs)` over `table` here; torch threads as in a one-CPU actor (1, or
    eval.cpu_threads), restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rec = Recommender(**kwargs)
        yield from (rec(table.slice(start, batch)) for start in range(0, table.num_rows, batch))
    finally:
        torch.set_num_threads(before)


def _metrics(ctx: StageContext, inp: _Inputs, recs: pl.DataFrame) -> dict[str, Any]:
    """metrics.json's content: per split the model's, the baselines' and the rank metrics, on
    all sampled users and on the cold slice (layout in docs/ARCHITECTURE.md)."""
    ec = ctx.cfg.eval
    n_returned, n_invalid = int(recs["n_returned"].sum()), int(recs["n_invalid"].sum())
    out: dict[str, Any] = {
        "splits": {}, "baselines": {b: {} for b in ec.baselines}, "ranks": {},
        "baseline_ranks": {}, "baseline_per_user": {}, "paired": {},
        "slices": {"cold": {"definition": {"max_sft_targets": ec.cold_max_sft_targets,
                                           "n_cold_items": inp.n_cold, "n_items": len(inp.catalog)}}},
        "invalid_sid_rate": n_invalid / n_returned if n_returned else 0.0, "n_users": {}, "n_rows": {},
        "per_user": {},
        "config": {"beam_width": ec.beam_width, "ks": list(ec.ks), "constrained": ec.constrained,
                   "normalise": ec.normalise, "bootstrap": ec.bootstrap, "max_users": ec.max_users, "exact_rank": ec.exact_rank,
                   "cold_max_sft_targets": ec.cold_max_sft_targets, "baselines": list(ec.baselines)},
    }
    for split in ec.splits:
        _split_metrics(ctx, inp, split, recs.filter(pl.col("split") == split), out)
    return out


def _split_metrics(ctx: StageContext, inp: _Inputs, split: str, part: pl.DataFrame, out: dict[str, Any]) -> None:
    """Fill `out` with one split's metrics; `part` = that split's decoded rows."""
    cfg, ec = ctx.cfg, ctx.cfg.eval
    ks, catalog, seqs, frame = list(ec.ks), inp.catalog, inp.seqs, inp.frames[split]
    users = part["user_id"].to_list()  # several rows per user with data.split=global_time
    summary, per_user = metric_block(part["items"].to_list(), part["target"].to_list(), ks, ec.bootstrap, cfg.seed,
                                     users)
    out["splits"][split] = summary
    out["n_users"][split] = len(set(users))
    out["n_rows"][split] = part.height
    out["per_user"][split] = {"user_ids": part["user_id"].to_list(), **per_user}
    ref = reference_block(seqs, split, frame, ks, ec.bootstrap, cfg.seed, catalog, ec.baselines, ec.exact_rank)
    for key, dest in (("baselines", "baselines"), ("ranks", "baseline_ranks"), ("per_user", "baseline_per_user")):
        for name, vals in ref[key].items():
            out[dest].setdefault(name, {})[split] = vals
    if ec.exact_rank:
        from gti.eval.rank import rank_metrics

        out["ranks"][split] = rank_metrics(part["exact_rank"].to_numpy(), len(catalog), ec.bootstrap, cfg.seed,
                                           groups=users)
        out["per_user"][split]["exact_rank"] = part["exact_rank"].to_list()
        ctx.log(format_ranks(split, out["ranks"][split]))
        for name, ranks in ref["ranks"].items():
            ctx.log(format_ranks(split, ranks, f"/{name}"))
    # After exact ranks: with them on both sides (the model, SASRec) MRR is the exact one.
    out["paired"][split] = paired_differences(out["per_user"][split], ref["per_user"], ks, ec.bootstrap, cfg.seed)
    # Masks per table (both carry the target), so the slice never depends on row order.
    cold_part = pl.Series(cold_users(part, inp.sft_counts, ec.cold_max_sft_targets), dtype=pl.Boolean)
    cold_frame = pl.Series(cold_users(frame, inp.sft_counts, ec.cold_max_sft_targets), dtype=pl.Boolean)
    out["slices"]["cold"][split] = cold_block = slice_metrics(
        part.filter(cold_part), frame.filter(cold_frame), seqs, split, ks, ec.bootstrap, cfg.seed,
        catalog, ec.exact_rank, ec.baselines,
    )
    if cold_block["ranks"]:
        ctx.log(format_ranks(split, cold_block["ranks"], "[cold]"))


def _write_outputs(ctx: StageContext, out: dict[str, Any], recs: pl.DataFrame) -> None:
    """metrics.json, the tracker's scalars and recs.parquet; the decoded chunks are then removed."""
    atomic_write_json(ctx.work_dir / METRICS_FILE, out)
    from gti.common.tracking import eval_tags, open_tracker

    with open_tracker(ctx) as tracker:
        tracker.scalars(eval_tags(out), int(ctx.manifest("sft").facts.get("steps_done") or 0))
    recs.select("user_id", "split", "target", "items", "scores").write_parquet(ctx.work_dir / RECS_FILE)
    shutil.rmtree(ctx.work_dir / DECODED_DIR)  # recs.parquet holds them now


def format_paired(out: dict[str, Any]) -> list[str]:
    """Log lines of the paired differences: per split and reference row, model - row at the
    headline K (Recall@K, NDCG@K, MRR), mean [paired bootstrap CI]."""
    k = paired_k(list(out["config"]["ks"]))
    lines = []
    for split, rows in out["paired"].items():
        for name, block in rows.items():
            cells = [f"{m.replace('recall', 'Recall').replace('ndcg', 'NDCG').replace('mrr', 'MRR')} "
                     f"{c['value']:+.4f} [{c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}]"
                     for m, c in block.items() if m in (f"recall@{k}", f"ndcg@{k}", "mrr", f"mrr@{k}")]
            lines.append(f"{split}: model - {name} (paired, {next(iter(block.values()))['n_users']} users): "
                         + ", ".join(cells))
    return lines
