"""The summary `gti run` prints once a run's evaluation is complete (and `gti summary` reprints).

What it is for: one screen that a new user reads at the end of `make demo`: the trained model
beside the reference rows on the same test users (Recall, NDCG, MRR with CIs, then the paired
differences), one real test user (the evaluate stage's first, not chosen for looking good) with
their history, true next item and the model's top items, what grounding did to the new rows,
the wall time of every stage, and the next commands to try. `read_run(run_dir, stages)` reads
the run folder into a `RunSummary`; `format_summary(s)` is the text (pure).

What it does not know: how the numbers were made (`gti.stages.evaluate`), Ray, the config
(the caller passes the stage order and, optionally, the config path for the commands).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import polars as pl

MODEL_ROW = "gti (SFT model)"
RL_ROW = "gti (RL model)"  # the model row when the rl stage trained (evaluate scored rl/model)
ROW_NAMES = {"sasrec": "SASRec", "markov": "Markov-1", "mostpop": "MostPop"}
SAMPLE_HISTORY = 3  # history items shown for the sample user (and passed to gti recommend)
SAMPLE_RECS = 5  # the model's top items shown for the sample user
TITLE_CHARS = 60
MANIFEST = "_manifest.json"


@dataclass
class Sample:
    """One test user of the evaluation: ids with titles, oldest history item first."""

    user_id: str
    split: str
    history: list[tuple[str, str]]  # the last SAMPLE_HISTORY items before the target
    n_history: int  # all the user's items before the target
    target: tuple[str, str]
    recs: list[tuple[str, str]]  # the model's top items, best first
    k: int  # how many items the model returned (the top-K the metrics used)
    list_rank: int | None = None  # the target's place in those k (1 = first), None when absent
    exact_rank: float | None = None  # the target's rank over the catalog (eval.exact_rank)


@dataclass
class RunSummary:
    """What `format_summary` prints; `run_dir` as the user spelled it (for the commands)."""

    run_dir: str
    metrics: dict[str, Any]
    durations: dict[str, float] = field(default_factory=dict)  # stage -> seconds, stage order
    sample: Sample | None = None
    report: str | None = None  # report.html when the report stage has written it
    config: str | None = None  # the config path, for the commands that need one
    grounding: dict[str, Any] | None = None  # the ground stage's facts (steps_done, rows, ...)
    rl: dict[str, Any] | None = None  # the rl stage's facts when it trained (best, stopped_at, ...)


# --------------------------------------------------------------------------- reading
def _manifest(stage_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((stage_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _output(run_dir: Path, stage: str, name: str, default: str) -> Path:
    """A stage output's path, by the name its manifest gives it (default: the contract's file)."""
    m = _manifest(run_dir / stage) or {}
    return run_dir / stage / (m.get("outputs") or {}).get(name, default)


def read_run(run_dir: str | Path, stages: Sequence[str], shown: str | None = None,
             config: str | None = None) -> RunSummary:
    """The summary of the run in `run_dir` (its evaluate stage complete: OSError/ValueError when
    metrics.json is missing or unreadable). `stages`: the pipeline's stage names in order;
    `shown`: how to print the run folder in the commands (default: `run_dir` as given)."""
    root = Path(run_dir)
    metrics = json.loads(_output(root, "evaluate", "metrics", "metrics.json").read_text())
    durations = {}
    for stage in stages:
        m = _manifest(root / stage)
        if m is not None and m.get("duration_s") is not None:
            durations[stage] = float(m["duration_s"])
    report = root / "report" / "report.html"
    ground = _manifest(root / "ground")
    rl = ((_manifest(root / "rl") or {}).get("facts")) or {}
    return RunSummary(
        run_dir=shown or str(run_dir), metrics=metrics, durations=durations,
        sample=read_sample(root, metrics), report=str(report) if report.is_file() else None, config=config,
        grounding=(ground or {}).get("facts"), rl=rl if rl.get("enabled") else None)


def summary_split(metrics: dict[str, Any]) -> str | None:
    """The split the summary shows: test when evaluated, else the first one."""
    splits = list(metrics.get("splits") or {})
    return "test" if "test" in splits else (splits[0] if splits else None)


def read_sample(run_dir: Path, metrics: dict[str, Any]) -> Sample | None:
    """The first user of the summary split in recs.parquet, with titles from ingest's
    items.parquet and history from its sequences.parquet; None when a file is missing."""
    split = summary_split(metrics)
    try:
        recs = pl.read_parquet(_output(run_dir, "evaluate", "recommendations", "recs.parquet"))
        recs = recs.filter(pl.col("split") == split).head(1)
        if recs.height == 0:
            return None
        row = recs.row(0, named=True)
        seqs = pl.read_parquet(_output(run_dir, "ingest", "sequences", "sequences.parquet"))
        user = seqs.filter(pl.col("user_id") == row["user_id"])
        items_path = _output(run_dir, "ingest", "items", "items.parquet")
        history = []
        if user.height:
            u = user.row(0, named=True)
            # The first row of a period: everything before the period (older tables: valid_item only).
            valid = u.get("valid_items") if u.get("valid_items") is not None else [u["valid_item"]]
            history = list(u["train_items"]) + (list(valid) if split == "test" else [])
        wanted = set(history[-SAMPLE_HISTORY:]) | {row["target"]} | set(row["items"][:SAMPLE_RECS])
        titles = dict(pl.read_parquet(items_path, columns=["item_id", "title"])
                      .filter(pl.col("item_id").is_in(list(wanted))).iter_rows())
    except (OSError, ValueError, pl.exceptions.PolarsError):
        return None

    def titled(item: str) -> tuple[str, str]:
        return item, titles.get(item) or ""

    return Sample(
        user_id=str(row["user_id"]), split=str(split), history=[titled(i) for i in history[-SAMPLE_HISTORY:]],
        n_history=len(history), target=titled(row["target"]), recs=[titled(i) for i in row["items"][:SAMPLE_RECS]],
        k=len(row["items"]), list_rank=row["items"].index(row["target"]) + 1 if row["target"] in row["items"] else None,
        exact_rank=_exact_rank(metrics, str(split), str(row["user_id"])))


def _exact_rank(metrics: dict[str, Any], split: str, user: str) -> float | None:
    per_user = (metrics.get("per_user") or {}).get(split) or {}
    ranks, users = per_user.get("exact_rank"), per_user.get("user_ids") or []
    if not ranks or user not in users:
        return None
    return ranks[users.index(user)]


# --------------------------------------------------------------------------- formatting
def summary_columns(ks: Sequence[int]) -> list[str]:
    """Recall@3 (the field's first column), Recall@5, Recall@10 and NDCG@10 where `eval.ks` has
    them, else the largest K's."""
    recall = [k for k in (3, 5, 10) if k in ks] or [max(ks)]
    return [f"recall@{k}" for k in recall] + [f"ndcg@{10 if 10 in ks else max(ks)}"]


def _cell(entry: Any) -> str:
    if not isinstance(entry, dict) or "value" not in entry:
        return "-"
    lo, hi = (entry.get("ci") or [None, None])[:2]
    ci = f" [{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else ""
    return f"{entry['value']:.3f}{ci}"


def table_rows(metrics: dict[str, Any], split: str, model_row: str = MODEL_ROW) -> list[tuple[str, list[str]]]:
    """(row name, cells) for the model, then SASRec, Markov-1, MostPop (and any other baseline
    present), cells in the order of `summary_columns` then MRR: exact-rank MRR where the run
    has exact ranks, else MRR@K of every row's top K (`mrr_at_k`)."""
    cols = summary_columns(list((metrics.get("config") or {}).get("ks") or _ks(metrics, split)))
    baselines = metrics.get("baselines") or {}
    exact = bool((metrics.get("ranks") or {}).get(split))
    ndcg, n_boot = cols[-1], int((metrics.get("config") or {}).get("bootstrap", 1000))
    per_user = (metrics.get("per_user") or {}).get(split) or {}
    model_mrr = ((metrics.get("ranks") or {}).get(split) or {}).get("mrr") if exact else mrr_at_k(
        per_user.get(ndcg), n_boot, per_user.get("user_ids"))
    rows = [(model_row, [_cell((metrics["splits"].get(split) or {}).get(c)) for c in cols] + [_cell(model_mrr)])]
    order = [b for b in ROW_NAMES if b in baselines] + [b for b in baselines if b not in ROW_NAMES]
    paired = (metrics.get("paired") or {}).get(split) or {}
    mrr_key = "mrr" if exact else f"mrr@{ndcg.split('@')[1]}"
    diffs = [(f"gti - {ROW_NAMES.get(name, name)}", [_signed(paired[name].get(c)) for c in cols + [mrr_key]])
             for name in order if name in paired]
    for name in order:
        table = baselines[name].get(split) or {}
        if exact:
            mrr = (((metrics.get("baseline_ranks") or {}).get(name) or {}).get(split) or {}).get("mrr")
        else:
            rows_of = (((metrics.get("baseline_per_user") or {}).get(name) or {}).get(split) or {})
            mrr = mrr_at_k(rows_of.get(ndcg), n_boot, rows_of.get("user_ids"))
        rows.append((row_name(metrics, name), [_cell(table.get(c)) for c in cols] + [_cell(mrr)]))
    return rows + diffs


def row_name(metrics: dict[str, Any], name: str) -> str:
    """A reference row's name: the label the evaluate stage recorded (SASRec: "SASRec (tuned on
    valid)" after its sweep), else ROW_NAMES's, else the config name."""
    label = (((metrics.get("reference") or {}).get(name)) or {}).get("label")
    return label or ROW_NAMES.get(name, name)


def _signed(entry: Any) -> str:
    """A paired difference: +0.012 [-0.010, +0.034]; '-' when absent."""
    if not isinstance(entry, dict) or "value" not in entry:
        return "-"
    lo, hi = (entry.get("ci") or [None, None])[:2]
    ci = f" [{lo:+.3f}, {hi:+.3f}]" if lo is not None and hi is not None else ""
    return f"{entry['value']:+.3f}{ci}"


def mrr_at_k(ndcg: Sequence[float] | None, n_boot: int,
             user_ids: Sequence[str] | None = None) -> dict[str, Any] | None:
    """MRR@K with its bootstrap CI (seed 0) from per-row NDCG@K of one target per row [R]:
    a hit at 0-based rank r has NDCG 1/log2(r + 2), so its reciprocal rank is 1/(r + 1); a miss
    (NDCG 0) counts 0. `user_ids` [R], each row's user: the CI resamples users with all their
    rows (the global time split has several per user), as every other CI does. None without
    per-row values (an older metrics.json)."""
    if ndcg is None:
        return None
    from gti.eval.metrics import bootstrap_ci
    from gti.eval.reference import reciprocal_ranks_at_k

    rr = reciprocal_ranks_at_k(ndcg)
    groups = user_ids if user_ids is not None and len(user_ids) == rr.size else None
    return {"value": float(rr.mean()) if rr.size else 0.0,
            "ci": list(bootstrap_ci(rr, n_boot=n_boot, seed=0, groups=groups))}


def _ks(metrics: dict[str, Any], split: str) -> list[int]:
    """The K values of a split's metric names (metrics.json without a config block)."""
    names = (metrics.get("splits") or {}).get(split) or {}
    return sorted({int(n.split("@")[1]) for n in names if "@" in n}) or [10]


def format_table(metrics: dict[str, Any], split: str, model_row: str = MODEL_ROW) -> str:
    ks = list((metrics.get("config") or {}).get("ks") or _ks(metrics, split))
    cols = summary_columns(ks)
    exact = bool((metrics.get("ranks") or {}).get(split))
    # Several rows per user (the global time split): the field calls the one-target Recall@K
    # HR@K, and the evaluate stage recorded hr@K as the same cell (docs/data.md, Splits).
    hr = several_rows(metrics, split) and f"hr@{cols[0].split('@')[1]}" in (metrics["splits"].get(split) or {})
    header = [c.replace("recall", "HR" if hr else "Recall").replace("ndcg", "NDCG") for c in cols] + [
        "MRR" if exact else f"MRR@{cols[-1].split('@')[1]}"]
    rows = table_rows(metrics, split, model_row)
    name_w = max(len(n) for n, _ in rows)
    widths = [max(len(h), *(len(cells[i]) for _, cells in rows)) for i, h in enumerate(header)]
    lines = ["  ".join([" " * name_w] + [h.rjust(w) for h, w in zip(header, widths)])]
    lines += ["  ".join([n.ljust(name_w)] + [c.rjust(w) for c, w in zip(cells, widths)]) for n, cells in rows]
    return "\n".join(lines)


def several_rows(metrics: dict[str, Any], split: str) -> bool:
    """True where the split evaluated more rows than users (the global time split)."""
    n_rows, n_users = (metrics.get("n_rows") or {}).get(split), (metrics.get("n_users") or {}).get(split)
    return n_rows is not None and n_users is not None and n_rows > n_users


def _mrr_note(metrics: dict[str, Any], split: str) -> str:
    ranks = (metrics.get("ranks") or {}).get(split)
    if not ranks:
        k = summary_columns(list((metrics.get("config") or {}).get("ks") or _ks(metrics, split)))[-1].split("@")[1]
        return (f"MRR@{k}: 1/rank of the true item in each row's top {k} (0 when absent); eval.exact_rank: true "
                "ranks every catalog item for the model and SASRec")
    n = ranks.get("n_items")
    return (f"MRR: from the true item's exact rank among all {f'{n:,} ' if n else ''}catalog items; '-': a row "
            "that ranks only its top K (MostPop, Markov-1)")


def _paired_note(metrics: dict[str, Any], split: str) -> list[str]:
    if not (metrics.get("paired") or {}).get(split):
        return []
    return ["gti - X: the model minus row X user by user on the same users, with a paired bootstrap CI "
            "(a CI above 0: the model is better)"]


def _title(item: tuple[str, str], id_width: int = 0) -> str:
    item_id, title = item
    title = title if len(title) <= TITLE_CHARS else title[: TITLE_CHARS - 3] + "..."
    return f"{item_id.ljust(id_width)}  {title or '(no title)'}"


def format_sample(s: Sample) -> list[str]:
    width = max(len(i) for i, _ in [*s.history, s.target, *s.recs])  # titles start in one column
    lines = [f"A {s.split} user ({s.user_id}, {s.n_history} items before the one to predict):"]
    if s.history:
        lines.append(f"  history, last {len(s.history)} (oldest first):")
        lines += [f"       {_title(h, width)}" for h in s.history]
    lines.append(f"  true next item:   {_title(s.target, width)}")
    lines.append(f"  the model's top {len(s.recs)}:")
    lines += [f"    {i + 1:>2}. {_title(r, width)}" + ("   <- the true next item" if i + 1 == s.list_rank else "")
              for i, r in enumerate(s.recs)]
    if s.list_rank is not None and s.list_rank > len(s.recs):
        lines.append(f"  (the true item is number {s.list_rank} of the model's top {s.k})")
    elif s.list_rank is None:
        where = f"; its exact rank over the catalog: {s.exact_rank:g}" if s.exact_rank is not None else ""
        lines.append(f"  (the true item is not in the model's top {s.k}{where})")
    return lines


def format_rl(facts: dict[str, Any]) -> str:
    """One line on what RL did: steps, the validation metric before and at its best step (step 0:
    the SFT model was kept), an early stop, the mean reward."""
    best = facts.get("best") or {}
    metric, start, value, step = best.get("metric", "val_mrr"), best.get("start"), best.get("value"), best.get("step")
    num = lambda v: "?" if v is None else f"{v:.3f}"  # noqa: E731
    kept = "the SFT model was kept (no step beat it)" if step == 0 else f"the model of step {step} was kept"
    stop = f"; stopped early at step {facts['stopped_at']}" if facts.get("stopped_at") else ""
    reward = (facts.get("step_stats") or {}).get("reward_mean")
    return (f"RL: {facts.get('steps_done', '?')} GRPO steps; validation {metric.removeprefix('val_')} {num(start)} "
            f"(SFT model) -> best {num(value)}: {kept}{stop}" + (f"; mean reward {reward:.3f}" if reward is not None else ""))


def format_grounding(facts: dict[str, Any]) -> str | None:
    """One line on the work grounding did (None when the facts predate the `rows` fact)."""
    rows = facts.get("rows")
    if not rows:
        return None
    lo, hi = facts.get("new_token_ids", [0, 0])
    rel = rows.get("moved_rel")
    scale = f" ({rel:.2f}x an old row's norm)" if rel is not None else ""
    rank = f"effective rank {rows['effective_rank_before']:.1f} -> {rows['effective_rank_after']:.1f}"
    if not facts.get("grounded"):
        return f"Grounding: off ({facts.get('init_method', '?')} init only); new rows' {rank}"
    return (f"Grounding: {facts.get('steps_done', '?')} steps moved the {hi - lo} new rows {rows['moved_mean']:.3g} "
            f"on average{scale}; their {rank} (1.0 = all rows equal)")


def format_durations(durations: dict[str, float]) -> str:
    total = sum(durations.values())
    parts = [f"{stage} {_secs(sec)}" for stage, sec in durations.items()]
    return "Wall time per stage: " + ", ".join(parts) + f"; total {_secs(total)}"


def _secs(sec: float) -> str:
    return f"{sec:.1f} s" if sec < 120 else f"{sec / 60:.1f} min"


def next_commands(s: RunSummary) -> list[tuple[str, str]]:
    """(command, what it does) for the next steps."""
    run = shlex.quote(s.run_dir)
    if s.report:
        report = (f"open {shlex.quote(s.report)}", "the report: plots, CIs, SID and embedding geometry")
    else:
        cfg = shlex.quote(s.config) if s.config else "<config>"
        report = (f"gti stage report --config {cfg}", f"writes the report, {s.run_dir}/report/report.html")
    history = ",".join(i for i, _ in s.sample.history) if s.sample and s.sample.history else "<id>,<id>,<id>"
    return [
        report,
        (f"gti recommend --run-dir {run} --history {shlex.quote(history)} --k 10",
         "top 10 for any history (item ids, oldest first)"),
        (f"gti serve --run-dir {run}", "the recommender over HTTP (Ray Serve), with a search page"),
        (f"gti infer --run-dir {run} --users all --k 10 --out {shlex.quote(s.run_dir + '/infer')}",
         "top 10 for every user, offline (Ray Data)"),
    ]


def format_summary(s: RunSummary) -> str:
    """The whole summary as text (no trailing newline)."""
    m = s.metrics
    split = summary_split(m)
    if split is None:
        return f"Run {s.run_dir}: its metrics.json has no split"
    n_users = (m.get("n_users") or {}).get(split)
    rows = f" ({m['n_rows'][split]:,} rows)" if several_rows(m, split) else ""
    lines = [f"Run {s.run_dir}: {split} split, {n_users if n_users is not None else '?'} users{rows}, the same "
             "users in every row; [95% bootstrap CI]", "", format_table(m, split, RL_ROW if s.rl else MODEL_ROW),
             _mrr_note(m, split)] + _paired_note(m, split)
    if s.sample is not None:
        lines += [""] + format_sample(s.sample)
    grounding = format_grounding(s.grounding) if s.grounding else None
    if grounding:
        lines += ["", grounding]
    if s.rl:
        lines += ["", format_rl(s.rl)]
    if s.durations:
        lines += ["", format_durations(s.durations)]
    cmds = next_commands(s)
    width = max(len(c) for c, _ in cmds)
    lines += ["", "Next:"] + [f"  {c.ljust(width)}  # {what}" for c, what in cmds]
    return "\n".join(lines)
