"""The `gti` command line: argparse subcommands, each handler a few lines.

What it is for: turning arguments into calls of `gti.run.pipeline`, `gti.config` and the stage
modules. It holds no ML logic. A user mistake (any `GtiError`) and a file-system error (disk
full, permission denied: any `OSError`) print one line and exit 2, also when Ray raised them
around a task's error (`gti.common.errors.user_error` unwraps them).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import sys
from typing import Callable, Sequence

from gti.common.errors import GtiError, one_line, user_error


def _top_k(text: str) -> int:
    """argparse type of `gti recommend --k`: an integer in [1, gti.eval.recommend.MAX_K], so a bad
    value fails before the run's model is loaded, naming --k."""
    from gti.eval.recommend import MAX_K, check_k

    try:
        return check_k(int(text), "--k")
    except (ValueError, GtiError):
        raise argparse.ArgumentTypeError(f"must be an integer between 1 and {MAX_K}, got {text!r}") from None


def _cfg(args):
    from gti import config

    return config.load(args.config, args.overrides)


def _preflight(cfg, args) -> None:
    """`gti doctor`'s checks before any resource is reserved (gti/preflight.py)."""
    if not args.no_preflight:
        from gti.doctor import preflight_or_raise

        preflight_or_raise(cfg)


def cmd_run(args) -> int:
    from gti.run import pipeline

    cfg = _cfg(args)
    _preflight(cfg, args)
    done = pipeline.run(cfg, from_stage=args.from_stage, to_stage=args.to_stage, force=args.force)
    if "evaluate" in done:  # the evaluation is complete: the one screen a new user reads
        try:
            print(_summary(cfg.resolved_run_dir(), cfg.run_dir, args.config), flush=True)
        except GtiError as err:  # the run itself succeeded: a summary it cannot read is a note
            print(f"gti: note: {one_line(str(err))}", file=sys.stderr)
    return 0


def _summary(run_dir, shown: str, config: str | None) -> str:
    """`gti.diagnostics.summary`'s text for a run folder (GtiError when it cannot be read)."""
    from pathlib import Path

    from gti.diagnostics.summary import format_summary, read_run
    from gti.run.pipeline import STAGE_NAMES

    if not (Path(run_dir) / "evaluate" / "_manifest.json").is_file():
        raise GtiError(f"{shown}: no finished evaluate stage (evaluate/_manifest.json missing); gti run makes one")
    try:
        return format_summary(read_run(run_dir, STAGE_NAMES, shown=shown, config=config))
    except (OSError, ValueError) as err:
        raise GtiError(f"{shown}: no summary: {one_line(str(err))}") from None


def cmd_summary(args) -> int:
    """`gti summary --run-dir R`: what `gti run` prints at the end, for a finished run."""
    print(_summary(args.run_dir, args.run_dir, args.config))
    return 0


def cmd_stage(args) -> int:
    from gti.run import pipeline

    cfg = _cfg(args)
    _preflight(cfg, args)
    pipeline.run(cfg, from_stage=args.name, to_stage=args.name, force=True)
    return 0


def cmd_config(args) -> int:
    from gti import config
    from gti.common.errors import ConfigError

    if args.explain and args.action != "show":
        raise ConfigError("--explain goes with 'gti config show'")
    cfg = _cfg(args)
    if args.action == "show" and args.explain:
        from gti.config.explain import explain

        print(explain(cfg), end="")
    elif args.action == "show":
        print(config.dump(cfg), end="")
    else:
        print(f"{args.config or '<defaults>'}: OK")
    return 0


def _delegate(module: str, func: str = "main", preflight: str | None = None) -> Callable[[argparse.Namespace], int]:
    """Handler that imports `module` only when the subcommand runs (keeps `gti --help` fast);
    `preflight` ("module:function", e.g. of gti.doctor): the checks of the command's part,
    run first unless --no-preflight."""

    def handler(args) -> int:
        if preflight and not getattr(args, "no_preflight", False):
            where, name = preflight.split(":")
            getattr(importlib.import_module(where), name)(args)
        return int(getattr(importlib.import_module(module), func)(args) or 0)

    return handler


def cmd_data_inspect(args) -> int:
    """`gti data inspect`: the pure inspector, handed the config validator."""
    from gti import config
    from gti.data import inspect

    return int(inspect.cli_main(args, validate=config.validate) or 0)


def _add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--config", "-c", required=required, help="YAML config (jobs/configs/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def build_parser() -> argparse.ArgumentParser:
    from gti.run.pipeline import STAGE_NAMES

    ap = argparse.ArgumentParser(prog="gti", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    _add_pipeline_commands(sub, STAGE_NAMES)  # run, stage, doctor, config
    _add_data_commands(sub)  # data synth | inspect | dense
    _add_trained_run_commands(sub)  # recommend, summary, refresh, serve, infer
    _add_compare_command(sub)
    _add_vocab_commands(sub)  # vocab ground
    _add_sid_commands(sub)  # sid export
    _add_tune_command(sub)
    return ap


def _add_pipeline_commands(sub, stage_names: Sequence[str]) -> None:
    """`gti run`, `gti stage`, `gti doctor`, `gti config`: the pipeline of one config."""
    p = sub.add_parser("run", help="run the pipeline (skips stages that are up to date)")
    _add_config_args(p)
    p.add_argument("--from", dest="from_stage", choices=stage_names)
    p.add_argument("--to", dest="to_stage", choices=stage_names)
    p.add_argument("--force", action="store_true", help="rerun stages even if up to date")
    p.add_argument("--no-preflight", action="store_true", help="skip the checks of gti doctor")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("stage", help="run one stage (its upstream must be complete)")
    p.add_argument("name", choices=stage_names)
    _add_config_args(p)
    p.add_argument("--no-preflight", action="store_true", help="skip the checks of gti doctor")
    p.set_defaults(func=cmd_stage)

    p = sub.add_parser("doctor", help="check GPUs, torch, bf16, DeepSpeed, model, disk and Ray auth for a config")
    _add_config_args(p, required=False)
    p.set_defaults(func=_delegate("gti.doctor", "cli_main"))

    p = sub.add_parser("config", help="show or validate a resolved config")
    p.add_argument("action", choices=["show", "validate"])
    _add_config_args(p, required=False)
    p.add_argument("--explain", action="store_true",
                   help="show: every resolved key with its value, its default and its meaning")
    p.set_defaults(func=cmd_config)


def _add_data_commands(sub) -> None:
    """`gti data synth | inspect | dense`."""
    p = sub.add_parser("data", help="data utilities")
    dsub = p.add_subparsers(dest="data_command", required=True)
    s = dsub.add_parser("synth", help="write a synthetic catalog + interactions")
    s.add_argument("--items", type=int, required=True)
    s.add_argument("--users", type=int, default=None, help="default: items // 2 (--walk: 20 * items)")
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--format", choices=["parquet", "csv", "jsonl"], default="parquet")
    s.add_argument("--walk", action="store_true",
                   help="write a permutation-walk data set (next item = fixed successor of the previous) "
                        "instead of the preference model")
    s.add_argument("--min-len", type=int, default=None, help="--walk: shortest user sequence (default 8, >= 4)")
    s.add_argument("--max-len", type=int, default=None, help="--walk: longest user sequence (default 14)")
    s.set_defaults(func=_delegate("gti.data.synth", "cli_main"))

    s = dsub.add_parser("inspect", help="describe your catalog (and interactions): columns, mapping guess, "
                                        "quarantine dry run; writes a data: config block")
    s.add_argument("path", help="items file, glob or folder (parquet, CSV/TSV, JSONL, Amazon, MovieLens)")
    s.add_argument("--interactions", default=None, help="interactions file, glob or folder")
    s.add_argument("--sample", type=int, default=10000, help="rows read from each input (default 10000)")
    s.add_argument("--out", default="data.yaml", help="where the data: block goes (default data.yaml)")
    s.add_argument("--force", action="store_true", help="replace --out if it exists")
    s.set_defaults(func=cmd_data_inspect)

    s = dsub.add_parser("dense", help="the top-N items and their active users, as a smaller data set")
    s.add_argument("--items-path", default="bundled:amazon-scientific", help="items parquet/CSV or bundled:<name>")
    s.add_argument("--interactions-path", default=None, help="default: same as --items-path (bundled)")
    s.add_argument("--items", type=int, required=True, help="keep the N most interacted items")
    s.add_argument("--min-user-len", type=int, default=5, help="keep users with >= this many interactions on them")
    s.add_argument("--out", required=True)
    s.set_defaults(func=_delegate("gti.data.dense", "cli_main"))


def _add_trained_run_commands(sub) -> None:
    """`gti recommend`, `gti summary`, `gti refresh`, `gti serve`, `gti infer`: commands on a
    finished run's folder."""
    p = sub.add_parser("recommend", help="top-K items for a history, from a finished run")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--history", required=True, help="comma-separated item ids, oldest first")
    p.add_argument("--k", type=_top_k, default=10, help="items to return (1 to 1000; default 10)")
    p.add_argument("--exclude-history", action="store_true",
                   help="leave the history's items out of the list, as gti serve does by default (default: kept)")
    p.add_argument("--version", type=int, default=None,
                   help="refresh version k (default: the newest; 0: the run before any refresh)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model's own code (never taken from the run folder)")
    p.set_defaults(func=_delegate("gti.run.loaded", "cli_main"))

    p = sub.add_parser("summary", help="what gti run prints at the end: the model beside SASRec, Markov-1 "
                                       "and MostPop, a sample user, the time per stage, the next commands")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--config", "-c", default=None, help="the run's config, named in the commands it suggests")
    p.set_defaults(func=cmd_summary)

    p = sub.add_parser("refresh", help="add new items to a trained run: SIDs from its frozen quantiser, "
                                       "a short grounding pass, a new SID-map version")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--items", required=True, help="the new items (same formats as data.items.path)")
    p.add_argument("--interactions", default=None, help="new interactions (optional; needed for refresh.sft_steps)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="overrides of the run's config, e.g. refresh.ground_steps=20 data.items.format=csv")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model's own code (never taken from the run folder)")
    p.add_argument("--no-preflight", action="store_true", help="skip the checks of gti doctor")
    p.set_defaults(func=_delegate("gti.refresh.command", "cli_main", preflight="gti.doctor:for_refresh"))
    _add_serve_command(sub)
    _add_infer_command(sub)


def _add_serve_command(sub) -> None:
    """`gti serve`: the run's recommender online (Ray Serve, gti/serve/)."""
    p = sub.add_parser("serve", help="serve a finished run's recommendations over HTTP (Ray Serve)")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--version", type=int, default=None,
                   help="refresh version k (default: the newest; 0: the run before any refresh)")
    p.add_argument("--host", default=None, help="address to bind (default serve.host: 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default serve.port: 8000)")
    p.add_argument("--route-prefix", default=None,
                   help="path to mount the service at, e.g. /gti (default serve.route_prefix: /)")
    p.add_argument("--replicas", type=int, default=None, help="replicas (default serve.replicas: 1)")
    p.add_argument("--config", "-c", default=None, help="YAML whose serve: section is used (not the run's)")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: a local Ray on 127.0.0.1)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model's own code (never taken from the run folder)")
    p.add_argument("overrides", nargs="*", metavar="serve.key=value", help="serve overrides, e.g. serve.max_k=50")
    p.add_argument("--no-preflight", action="store_true", help="skip the checks of gti doctor")
    p.set_defaults(func=_delegate("gti.serve.deployment", "cli_main", preflight="gti.doctor:for_serve"))


def _add_infer_command(sub) -> None:
    """`gti infer`: the run's recommendations for many users, offline (Ray Data, gti/serve/infer*.py)."""
    p = sub.add_parser("infer", help="top-K items for every user (or a users file), written as resumable "
                                     "parquet parts (Ray Data)")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--users", required=True,
                   help="'all' (the run's users, their whole history) or a parquet/CSV/TSV/JSONL file with "
                        "user_id and optionally history (item ids oldest first; else the run's)")
    p.add_argument("--k", type=_top_k, default=10, help="items per user (1 to 1000; default 10)")
    p.add_argument("--out", required=True, help="output folder of parquet parts (rerun the same command to resume)")
    p.add_argument("--version", type=int, default=None,
                   help="refresh version k (default: the newest; 0: the run before any refresh)")
    p.add_argument("--exclude-history", action="store_true", help="leave each user's history items out")
    p.add_argument("--part-rows", type=int, default=None, help="users per part file (default 4096)")
    p.add_argument("--batch-users", type=int, default=None, help="histories per decode (default serve.infer_batch_users)")
    p.add_argument("--concurrency", type=int, default=None, help="decoding actors of a Ray Data pool (default "
                   "eval.concurrency; a catalog of at most local_max_items with one decoder: in this process)")
    p.add_argument("--num-gpus", type=float, default=None, help="GPUs per actor (default eval.num_gpus)")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: the run's, else a local Ray)")
    p.add_argument("--force", action="store_true", help="replace the parts of another gti infer job in --out")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model's own code (never taken from the run folder)")
    p.set_defaults(func=_delegate("gti.serve.infer_ray", "cli_main"))


def _add_compare_command(sub) -> None:
    """`gti compare`: initialisation arms x seeds, one report."""
    p = sub.add_parser("compare", help="run initialisation arms x seeds and write one report")
    _add_config_args(p)
    p.add_argument("--arms", default="mean,gti")
    p.add_argument("--seeds", default="1",
                   help="seeds per arm: N, or N,ARM=M,... (e.g. 3,random=1)")
    p.add_argument("--sid-seeds", type=int, default=1,
                   help="SID maps to train every arm x seed on (sid.seed = base, base+1, ...; base: sid.seed, "
                   "else seed); compare.json gives each map's figures and their mean over maps with the spread")
    p.add_argument("--out", default=None, help="output folder (default: <run_dir>/compare)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: report on the finished runs and stored records")
    p.add_argument("--no-preflight", action="store_true", help="skip the checks of gti doctor")
    p.set_defaults(func=_delegate("gti.experiments.compare", "cli_main", preflight="gti.experiments.compare:preflight"))


def _add_vocab_commands(sub) -> None:
    """`gti vocab ground`: grounding any new vocabulary into a HF model."""
    p = sub.add_parser("vocab", help="new-vocabulary utilities")
    vsub = p.add_subparsers(dest="vocab_command", required=True)
    s = vsub.add_parser("ground", help="add new tokens with descriptions to a HF model, ground only their "
                                       "rows (Ray Train + DeepSpeed) and export a standard HF folder")
    s.add_argument("--model", required=True, help="HF model folder (safetensors, chat template) or smollm2-135m")
    s.add_argument("--tokens", required=True,
                   help='JSONL: {"token": "<tool_search>", "descriptions": ["..."]} per line (or a YAML list)')
    s.add_argument("--out", required=True,
                   help="output model folder: new, empty or an earlier gti export (replaced whole)")
    s.add_argument("--force", action="store_true",
                   help="replace --out even when it is a non-empty folder that is not a gti export "
                        "(never the model folder, the current or home directory)")
    s.add_argument("--config", "-c", default=None, help="YAML: seed, init, ground, templates, ... (gti.vocab_ground)")
    s.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. ground.steps=50")
    s.add_argument("--no-preflight", action="store_true", help="skip the checks of gti doctor")
    s.set_defaults(func=_delegate("gti.vocab_ground", "cli_main", preflight="gti.doctor:for_vocab_ground"))


def _add_sid_commands(sub) -> None:
    """`gti sid export`: a run's SID map in the index.json form MiniOneRec and LC-Rec read."""
    p = sub.add_parser("sid", help="SID map utilities")
    ssub = p.add_subparsers(dest="sid_command", required=True)
    s = ssub.add_parser("export", help='write a run\'s SID map as index.json (item -> ["<a_12>", "<b_3>", ...])')
    s.add_argument("--run-dir", required=True, help="a run whose sid stage has completed")
    s.add_argument("--out", required=True, help="the index.json to write (replaced if it exists)")
    s.add_argument("--item-json", default=None,
                   help="their item.json (or .item2id): keys become its indices; a path that does not exist is "
                        "written first (indices 0.. in item id order, with titles and descriptions)")
    s.set_defaults(func=cmd_sid_export)


def cmd_sid_export(args) -> int:
    """`gti sid export`: the run's sid stage map (not a refresh version's) as index.json."""
    from pathlib import Path

    from gti.run.manifest import Manifest
    from gti.sid.from_file import export_index_json

    run = Path(args.run_dir).expanduser()
    sid = Manifest.read(run / "sid")
    item_json = Path(args.item_json).expanduser() if args.item_json else None
    got = export_index_json(sid.output(run / "sid", "sid_map"), sid.facts["token_format"], Path(args.out).expanduser(),
                            item_json, run / "ingest" / "items.parquet")
    print(f"{args.out}: {got['items']} items, {got['levels']} levels (map {sid.facts['sid_map_hash']})"
          + (f"; wrote {args.item_json}" if got["item_json_written"] else ""))
    return 0


def _add_tune_command(sub) -> None:
    """`gti tune`: a Ray Tune sweep over the grounding stage."""
    p = sub.add_parser("tune", help="Ray Tune sweep over the grounding stage")
    _add_config_args(p)
    p.add_argument("--no-preflight", action="store_true", help="skip the checks of gti doctor")
    p.set_defaults(func=_delegate("gti.experiments.tune", "cli_main", preflight="gti.doctor:for_tune"))


# Errors a user fixes on the machine (space, permissions), not in the config or the data.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def os_error_line(err: OSError) -> str:
    """One line for an OSError: the file, the system's reason and, for a failed write, what
    happened to the outputs (stages write into <run_dir>/.<stage>.partial and replace their
    folder only once complete, so earlier outputs are as they were)."""
    if err.filename and err.strerror:
        what = f"{err.filename}: {err.strerror}"
    else:  # pyarrow and others put everything in the message, sometimes over several lines
        what = (str(err).strip() or type(err).__name__).splitlines()[0]
    if err.errno in _WRITE_ERRNOS:
        what += (" (outputs of completed stages are unchanged; free space or fix permissions, "
                 "then rerun the same command to resume)")
    return what


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    # Overrides may come before or after options (`gti run -c X a=1 --to sid b=2`); argparse
    # alone would reject the ones after an option, so collect key=value leftovers here.
    args, extra = ap.parse_known_args(argv)
    bad = [e for e in extra if "=" not in e or e.startswith("-")]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        if not hasattr(args, "overrides"):
            ap.error(f"{args.command} takes no key=value overrides: {' '.join(extra)}")
        args.overrides = list(args.overrides or []) + extra
    try:
        return args.func(args)
    except Exception as err:  # noqa: BLE001 - user errors become one line; anything else re-raises
        user = user_error(err)
        # Ray's RayTaskError(OSError) is an OSError whose str() is Ray's report: use its cause.
        os_err = next((e for e in (getattr(err, "cause", None), err) if isinstance(e, OSError)), None)
        if user is None and os_err is None:
            raise
        from gti.common.redact import redact_text  # a URI's credentials quoted in an error

        print(f"gti: error: {redact_text(one_line(str(user) if user is not None else os_error_line(os_err)))}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gti: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
