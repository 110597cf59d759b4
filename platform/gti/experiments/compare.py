"""`gti compare`: every initialisation arm x seed on identical data, SIDs, budgets; one report.

    gti compare --config X --arms mean,gti,random --seeds 3 [--sid-seeds 3] [--out DIR]

What it is for: an arm is a set of config overrides on the user's config (`ARMS`: every arm
sets the same keys). The stages up to pairs run once, shared; each arm x seed (x SID map) runs
ground..report on them with its overrides and seed, one after another or as Ray tasks, and
resumes where it stopped; finished runs leave records that a later session can reuse. The
arms, the step budget, the layout under `--out`, records and parallelism: docs/commands.md.

What it does not know: what the stages compute; it only prepares configs and run folders,
drives `gti.run.pipeline`, and hands the finished runs to `gti.diagnostics.report_files`.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from gti import config as C
from gti.run import pipeline
from gti.config.io import apply_overrides
from gti.common.errors import GtiError
from gti.experiments.compare_report import write_maps_report, write_report
from gti.experiments.records import read_record, record_path, records_dir, shared_identity, write_record
from gti.experiments.shared_stages import (
    SHARED_STAGES, ArmRun, CompareError, adopt_shared, map_dirs, map_overrides, map_tag, run_shared, slug,
)
from gti.experiments.sid_maps import sid_seeds
from gti.common.files import atomic_write_json
from gti.train import resources

ARMS: dict[str, dict[str, Any]] = {
    "mean": {"init.method": "mean", "ground.enabled": False, "sft.multitask": False, "rl.enabled": False},
    "random": {"init.method": "random", "ground.enabled": False, "sft.multitask": False, "rl.enabled": False},
    "description": {"init.method": "description", "ground.enabled": False, "sft.multitask": False, "rl.enabled": False},
    "gti": {"init.method": "mean", "ground.enabled": True, "sft.multitask": False, "rl.enabled": False},
    "gti+multitask": {"init.method": "mean", "ground.enabled": True, "sft.multitask": True, "rl.enabled": False},
    "gti+rl": {"init.method": "mean", "ground.enabled": True, "sft.multitask": False, "rl.enabled": True},
    "lcrec": {"init.method": "mean", "ground.enabled": False, "sft.multitask": True, "rl.enabled": False},
    # Extra ablations (not in the paper's table): other initialisations without grounding.
    "mean_noise": {"init.method": "mean_noise", "ground.enabled": False, "sft.multitask": False, "rl.enabled": False},
    "codebook": {"init.method": "codebook", "ground.enabled": False, "sft.multitask": False, "rl.enabled": False},
}
ARM_STAGES = [s for s in pipeline.STAGE_NAMES if s not in SHARED_STAGES]
WAIT_POLL_S = 60.0  # longest single ray.wait while arm runs are in flight (deadlines are checked between)


def _echo(msg: str) -> None:
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- arms -> configs
def parse_arms(text: str | Sequence[str]) -> list[str]:
    """'mean,gti' -> ['mean', 'gti']; unknown or repeated arms raise CompareError."""
    arms = [a.strip() for a in (text.split(",") if isinstance(text, str) else text) if a.strip()]
    if not arms:
        raise CompareError("--arms is empty (known arms: " + ", ".join(ARMS) + ")")
    for a in arms:
        if a not in ARMS:
            raise CompareError(f"--arms: unknown arm '{a}' (known: {', '.join(ARMS)})")
    if len(set(arms)) != len(arms):
        raise CompareError(f"--arms: arm listed twice in '{','.join(arms)}'")
    return arms


def arm_overrides(cfg: C.RunConfig, arm: str) -> list[str]:
    """key=value overrides that turn the base config into `arm` (with the step budget; gti+rl's RL steps are extra)."""
    ov = dict(ARMS[arm])
    if cfg.compare.equal_budget and not ov["ground.enabled"]:
        ov["sft.steps"] = cfg.sft.steps + cfg.ground.steps
    ov["report.label"] = arm
    return [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in ov.items()]


def seeds_for(cfg: C.RunConfig, n: int) -> list[int]:
    if n < 1:
        raise CompareError(f"--seeds must be >= 1, got {n}")
    return [cfg.seed + i for i in range(n)]


def parse_seeds(spec: int | str | Mapping[str, int], arms: Sequence[str]) -> dict[str, int]:
    """Seeds per arm from `--seeds`: `3` (every arm), or `3,random=1` / `mean=3,gti=3,random=1`
    (a default count and per-arm counts; an arm without one gets the default, 1 if none)."""
    if isinstance(spec, Mapping):
        counts = {a: int(spec.get(a, 1)) for a in arms}
        unknown = sorted(set(spec) - set(arms))
    else:
        default, per_arm = 1, {}
        for part in [p.strip() for p in str(spec).split(",") if p.strip()]:
            key, eq, val = part.partition("=")
            try:
                n = int(val if eq else key)
            except ValueError:
                raise CompareError(f"--seeds: '{part}' is not N or ARM=N (e.g. 3 or 3,random=1)") from None
            if eq:
                per_arm[key.strip()] = n
            else:
                default = n
        counts = {a: per_arm.get(a, default) for a in arms}
        unknown = sorted(set(per_arm) - set(arms))
    if unknown:
        raise CompareError(f"--seeds names arm(s) {', '.join(unknown)} that are not in --arms {','.join(arms)}")
    for arm, n in counts.items():
        if n < 1:
            raise CompareError(f"--seeds must be >= 1 for every arm, got {arm}={n}")
    return counts


def arm_config(cfg: C.RunConfig, arm: str, seed: int, run_dir: Path, sid_seed: int | None = None) -> C.RunConfig:
    """The validated config of one arm x seed run in `run_dir` (on map `sid.seed=sid_seed`)."""
    raw = cfg.model_dump(mode="json")
    ov = arm_overrides(cfg, arm) + [f"seed={seed}", f"run_dir={run_dir}"] + map_overrides(sid_seed)
    where = "" if sid_seed is None else f" sid.seed {sid_seed}"
    return C.validate(apply_overrides(raw, ov), f"arm '{arm}' seed {seed}{where}")


def plan(cfg: C.RunConfig, arms: Sequence[str], n_seeds: int | str | Mapping[str, int], out: Path,
         n_maps: int = 1) -> list[ArmRun]:
    """All arm x seed runs on each of `n_maps` SID maps (`sid_seeds`), seed-major (every arm of
    seed s on every map before any run of seed s+1; an arm with fewer seeds, `parse_seeds`,
    drops out after its last), with their configs and run folders
    (`<runs root>/<arm>/seed<s>`, `map_dirs`). Seed-major so that a comparison stopped
    part-way (a long CPU run spans sessions) always holds complete, paired seeds to report on."""
    counts = parse_seeds(n_seeds, arms)
    maps = sid_seeds(cfg, n_maps)
    runs = []
    for seed in seeds_for(cfg, max(counts.values())):
        for m in maps:
            for arm in arms:
                if seed - cfg.seed < counts[arm]:
                    rd = map_dirs(out, m)[1] / slug(arm) / f"seed{seed}"
                    runs.append(ArmRun(arm, seed, rd, arm_config(cfg, arm, seed, rd, m), m))
    return runs


# --------------------------------------------------------------------------- arm runs
def first_incomplete(cfg: C.RunConfig, run_dir: Path) -> str | None:
    """First of ground..report that is missing or stale in run_dir (None: all up to date)."""
    for name in ARM_STAGES:
        if not pipeline.is_complete(pipeline.spec(name), cfg, run_dir):
            return name
    return None


def run_arm(cfg_json: dict[str, Any], cwd: str | None = None) -> dict[str, Any]:
    """Run the arm stages of one prepared run folder; returns a small summary (picklable).

    Called in-process or as a Ray task (then `cwd` restores the driver's working directory,
    so relative data paths in the config resolve the same way).
    """
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    cfg = C.validate(cfg_json, "arm config")
    run_dir = cfg.resolved_run_dir()
    start = first_incomplete(cfg, run_dir)
    t0 = time.time()
    if start is None:
        return {"run_dir": str(run_dir), "skipped": True, "seconds": 0.0}
    pipeline.run(cfg, from_stage=start)
    return {"run_dir": str(run_dir), "skipped": False, "from": start, "seconds": round(time.time() - t0, 1)}


# --------------------------------------------------------------------------- scheduling
def auto_parallel(cfg: C.RunConfig, cluster: dict[str, float]) -> int:
    """How many arm runs fit at once: cluster CPUs (and GPUs) / what one run holds at a time (its
    largest Train worker group or evaluate pool, plus CPU headroom for its Ray Data tasks; gti.train.resources)."""
    return resources.runs_that_fit(resources.run_need(cfg, ("ground", "sft", "rl", "evaluate")), cluster)


def execute(
    runs: Sequence[ArmRun], cfg: C.RunConfig, echo: Callable[[str], None] = _echo,
    on_done: Callable[[ArmRun], None] = lambda r: None,
) -> dict[tuple, str]:
    """Run every arm x seed; returns {ArmRun.key: error text} for the runs that failed.
    `on_done(run)` is called as soon as each run has finished (the record is kept then, so a
    session that ends mid-comparison loses only the run in progress)."""
    failures: dict[tuple, str] = {}
    width = 1
    if cfg.compare.parallel and len(runs) > 1:
        from gti.ray_start import ensure_ray

        ensure_ray(cfg)
        import ray

        width = cfg.compare.max_parallel or auto_parallel(cfg, ray.cluster_resources())
    if width <= 1:
        for r in runs:
            echo(f"{r.name}: running in {r.run_dir}")
            try:
                info = run_arm(r.cfg.model_dump(mode="json"))
                echo(f"{r.name}: {'up to date' if info['skipped'] else 'done'}")
                on_done(r)
            except Exception as err:  # one failed arm must not lose the others
                failures[r.key] = _describe(err)
                echo(f"{r.name}: FAILED: {failures[r.key].splitlines()[0]}")
        return failures

    import ray

    have = float(ray.cluster_resources().get("CPU", 0.0))
    if cfg.compare.arm_num_cpus > have:  # the arm tasks could never be scheduled
        raise CompareError(f"compare.arm_num_cpus {cfg.compare.arm_num_cpus:g} exceeds the cluster's {have:g} CPUs")
    echo(f"running {len(runs)} arm runs, up to {width} at once (Ray tasks)")
    task = ray.remote(num_cpus=cfg.compare.arm_num_cpus, max_retries=0)(run_arm)
    pending: dict[Any, ArmRun] = {}
    deadline: dict[Any, float] = {}  # ref -> when it is cancelled (compare.arm_timeout_s after submission)
    queue = list(runs)
    while queue or pending:
        while queue and len(pending) < width:
            r = queue.pop(0)
            echo(f"{r.name}: submitted ({r.run_dir})")
            ref = task.remote(r.cfg.model_dump(mode="json"), os.getcwd())
            pending[ref], deadline[ref] = r, time.monotonic() + cfg.compare.arm_timeout_s
        wait_s = max(0.0, min(min(deadline.values()) - time.monotonic(), WAIT_POLL_S))
        done, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
        if not done:
            for ref in [ref for ref, t in deadline.items() if t <= time.monotonic()]:
                r = pending.pop(ref)
                del deadline[ref]
                ray.cancel(ref, force=True)  # its worker (and the Train run it drives) goes with it
                failures[r.key] = (f"compare.arm_timeout_s: not finished {cfg.compare.arm_timeout_s:g}s "
                                             "after its submission, cancelled (raise it for longer arm runs)")
                echo(f"{r.name}: FAILED: {failures[r.key]}")
            continue
        r = pending.pop(done[0])
        del deadline[done[0]]
        try:
            info = ray.get(done[0])
            echo(f"{r.name}: {'up to date' if info['skipped'] else 'done in %.0fs' % info['seconds']}")
            on_done(r)
        except Exception as err:
            cause = getattr(err, "cause", None) or err
            failures[r.key] = _describe(cause)
            echo(f"{r.name}: FAILED: {failures[r.key].splitlines()[0]}")
    return failures


def _describe(err: BaseException) -> str:
    if isinstance(err, GtiError):
        return str(err)
    return f"{type(err).__name__}: {err}\n" + "".join(traceback.format_exception(err))


# --------------------------------------------------------------------------- entry points
def compare(
    cfg: C.RunConfig, arms: Sequence[str], n_seeds: int | str | Mapping[str, int],
    out: str | Path | None = None, echo: Callable[[str], None] = _echo, report_only: bool = False,
    n_maps: int = 1,
) -> dict[str, Path]:
    """Shared stages once per SID map (`n_maps`, `sid_seeds`), every arm x seed on each (or its
    stored record), one report; returns the report paths. `report_only`: run nothing, report on
    what is finished or recorded. A run (not `report_only`, a reader) holds `out`'s writer lock
    (`gti.run.runlock`) throughout."""
    from contextlib import nullcontext

    from gti.run.runlock import RunLock

    arms = parse_arms(list(arms))
    out = Path(out).expanduser().resolve() if out else cfg.resolved_run_dir() / "compare"
    with nullcontext() if report_only else RunLock(out):
        return _compare(cfg, arms, n_seeds, out, echo, report_only, n_maps)


def _sort_runs(runs: Sequence[ArmRun], rdir: Path, identities: Mapping[int | None, dict[str, str]],
               echo: Callable[[str], None]) -> tuple[list[ArmRun], dict[tuple, Any], set[tuple]]:
    """(the runs still to run, {key: (record, facts)} of the runs a stored record stands for,
    keys of the runs complete in their folders here)."""
    todo, stored, complete = [], {}, set()
    for r in runs:
        if first_incomplete(r.cfg, r.run_dir) is None:
            complete.add(r.key)
        else:
            rec, facts, why = read_record(r, rdir, identities[r.sid_seed])
            if rec is not None:
                stored[r.key] = (rec, facts)
                echo(f"{r.name}: finished earlier, taken from {record_path(rdir, r.arm, r.seed, r.sid_seed)}")
                continue
            if why:
                echo(f"{r.name}: record not used, the run goes again: {why}")
        todo.append(r)
    return todo, stored, complete


def _plan_doc(cfg: C.RunConfig, arms: list[str], n_seeds, runs: Sequence[ArmRun], dirs: Mapping[int | None, Path],
              identities: Mapping[int | None, dict[str, str]], rdir: Path, stored) -> dict[str, Any]:
    """compare.json as the runs start: one map, the keys it always had; several, each map's
    shared folder and hashes by `sid<m>` and each run's `sid_seed`."""
    doc: dict[str, Any] = {
        "arms": {a: arm_overrides(cfg, a) for a in arms},
        "seeds": {a: seeds_for(cfg, n) for a, n in parse_seeds(n_seeds, arms).items()},
        "equal_budget": cfg.compare.equal_budget,
    }
    if list(dirs) == [None]:
        doc.update(shared_run_dir=str(dirs[None]), shared_identity=identities[None])
    else:
        doc.update(sid_seeds=list(dirs), shared_run_dirs={map_tag(m): str(d) for m, d in dirs.items()},
                   shared_identity={map_tag(m): identities[m] for m in dirs})
    doc["records_dir"] = str(rdir)
    doc["runs"] = [{"arm": r.arm, "seed": r.seed, **({} if r.sid_seed is None else {"sid_seed": r.sid_seed}),
                    "run_dir": str(r.run_dir), "from_record": r.key in stored} for r in runs]
    return doc


def _compare(cfg: C.RunConfig, arms: list[str], n_seeds, out: Path, echo: Callable[[str], None],
             report_only: bool, n_maps: int = 1) -> dict[str, Path]:
    runs = plan(cfg, arms, n_seeds, out, n_maps)  # validates every arm config before any work
    dirs = run_shared(cfg, out, sid_seeds(cfg, n_maps), report_only, echo)
    identities = {m: shared_identity(d) for m, d in dirs.items()}
    rdir = records_dir(cfg, out)
    todo, stored, complete = _sort_runs(runs, rdir, identities, echo)
    if not report_only:
        # Only into runs that still have stages to run: re-linking the shared stages into a
        # finished run (e.g. one left from an earlier session, whose shared folder has been
        # rebuilt since) would make its ground stage look stale and run the whole arm again.
        for r in todo:
            if r.key not in complete:
                adopt_shared(dirs[r.sid_seed], r.run_dir)
    atomic_write_json(out / "compare.json", _plan_doc(cfg, arms, n_seeds, runs, dirs, identities, rdir, stored))

    def keep(r: ArmRun) -> None:
        try:
            echo(f"{r.name}: record kept in {write_record(r, rdir, identities[r.sid_seed])}")
        except (OSError, GtiError) as err:  # the run itself is fine; say so and go on
            echo(f"{r.name}: could not keep its record: {err}")

    if report_only:  # a run with a report stands as made (even by older code): keep it
        failures = {}
        for r in todo:
            if (r.run_dir / "report" / "_manifest.json").is_file():
                keep(r)
    else:
        failures = execute(todo, cfg, echo, on_done=keep)
    ok = [r for r in runs if r.key not in failures]
    counts = parse_seeds(n_seeds, arms)
    title = f"gti comparison: {', '.join(f'{a} x {counts[a]}' for a in arms)} seed(s)"
    if len(dirs) > 1:
        title += f" on {len(dirs)} SID maps (sid.seed {', '.join(str(m) for m in dirs)})"
        paths = write_maps_report(ok, cfg, out, title, stored, echo) if ok else {}
    else:
        paths = write_report(ok, cfg, out, title, stored) if ok else {}
    if failures:
        failed = [r for r in runs if r.key in failures]
        for r in failed:
            print(f"--- {r.name} failed:\n{failures[r.key]}", file=sys.stderr)
        names = ", ".join(("" if r.sid_seed is None else f"{map_tag(r.sid_seed)}/") + f"{r.arm}/seed{r.seed}"
                          for r in failed)
        where = f"; report over the others: {paths['html']}" if paths else ""
        raise CompareError(f"{len(failures)} of {len(runs)} arm runs failed ({names}){where}")
    return paths


def preflight(args) -> None:
    """`gti compare`'s preflight (gti.doctor): every arm's own config (an arm may turn on
    grounding that the base config has off), a problem's line naming its arm. Nothing for
    --report-only, which runs nothing."""
    if getattr(args, "report_only", False):
        return
    from gti import doctor

    cfg = C.load(args.config, list(getattr(args, "overrides", None) or []))
    out = Path(args.out).expanduser() if getattr(args, "out", None) else cfg.resolved_run_dir() / "compare"
    doctor.preflight_each({f"arm '{a}'": arm_config(cfg, a, cfg.seed, out / "runs" / slug(a))
                           for a in parse_arms(args.arms)})


def cli_main(args) -> int:
    cfg = C.load(args.config, list(getattr(args, "overrides", None) or []))
    arms = parse_arms(args.arms)
    n_seeds = parse_seeds(args.seeds, arms)  # CompareError naming the bad part, before any work
    n_maps = 1 if getattr(args, "sid_seeds", None) is None else int(args.sid_seeds)
    sid_seeds(cfg, n_maps)  # likewise for --sid-seeds
    paths = compare(cfg, arms, n_seeds, getattr(args, "out", None),
                    report_only=bool(getattr(args, "report_only", False)), n_maps=n_maps)
    print(paths["html"])
    return 0
