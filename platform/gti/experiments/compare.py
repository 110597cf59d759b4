"""`gti compare`: every initialisation arm x seed on identical data, SIDs, budgets; one report.

    gti compare --config X --arms mean,random,description,gti,gti+multitask,gti+rl,lcrec --seeds 3 [--out DIR]

Arms are sets of config overrides applied on top of the user's config (every arm sets the
same keys, so nothing leaks from the base config into one arm and not another):

| arm           | init.method | ground.enabled | sft.multitask | rl.enabled | sft.steps (equal_budget on) |
|---------------|-------------|----------------|---------------|------------|-----------------------------|
| mean          | mean        | false          | false         | false      | sft.steps + ground.steps    |
| random        | random      | false          | false         | false      | sft.steps + ground.steps    |
| description   | description | false          | false         | false      | sft.steps + ground.steps    |
| gti           | mean        | true           | false         | false      | sft.steps                   |
| gti+multitask | mean        | true           | true          | false      | sft.steps                   |
| gti+rl        | mean        | true           | false         | true       | sft.steps (+ rl.steps GRPO) |
| lcrec         | mean        | false          | true          | false      | sft.steps + ground.steps    |
| mean_noise    | mean_noise  | false          | false         | false      | sft.steps + ground.steps    |
| codebook      | codebook    | false          | false         | false      | sft.steps + ground.steps    |

`compare.equal_budget` (default true) gives arms without grounding the grounding steps as extra
SFT steps, so every arm takes the same number of optimizer steps (steps, not tokens: a
grounding step and an SFT step see different sequences). RL is outside that budget (a GRPO
step is another kind of step): `gti+rl` keeps `gti`'s ground and SFT steps and adds `rl.steps`
on top. Each arm also gets `report.label=<arm>` and `seed=<s>`.

Layout under `--out` (default `<run_dir>/compare`):
- `shared/`: ingest -> embed -> sid -> pairs, run ONCE with the base seed (`seed` of the
  config). SIDs and grounding pairs are therefore identical across arms and seeds.
- `runs/<arm>/seed<s>/`: the shared stage folders hard-linked (copied across file systems), then
  ground -> sft -> rl -> evaluate -> report with that arm's overrides and seed.
- `report.html|json|csv`, `plots/`, `compare.json`: one report over all arms x seeds.

Seeds are `seed, seed+1, ..., seed+N-1`. The seed enters every stage fingerprint, so the
linked shared stages (fingerprinted with the base seed) would look stale to a run with another
seed. The harness therefore starts each arm run at `--from <first incomplete stage from
ground on>` (the pipeline takes stages before `--from` as they are) and skips runs whose
ground..report stages are all up to date, so rerunning `gti compare` resumes where it stopped.

Parallelism: with `compare.parallel` (default) and more than one run allowed at once, every arm
x seed pipeline is a Ray task (`num_cpus=compare.arm_num_cpus`, default 0: the task only drives
its stages, whose Ray Data tasks and Train workers request their own resources).
`compare.max_parallel` caps concurrent runs; None sizes it from the cluster: CPUs (and GPUs when
training uses them) divided by what one run holds at a time (its Train workers plus a CPU of
headroom for its Ray Data tasks). An arm task not finished `compare.arm_timeout_s` after its
submission is cancelled and counted as failed. Otherwise runs go one after another in this
process. On a multi-node cluster `--out` must be on storage every node sees (as `run_dir` must
be for any multi-node run): an arm task may land on any node.

Records (resuming on another machine or in a later session): as each arm run finishes, its
report record (metrics with per-user values, diagnostics, curves, timing, config) is written to
`compare.records_dir` (default `<out>/records`) as `<arm>/seed<s>.json`, beside the content
hashes of what it inherited (catalog, sequences, SID map, codebooks, grounding pairs). A later
`gti compare` whose run folder for that arm x seed is missing takes the record instead of
rerunning it when the record's config equals the run's (after validating it with today's code,
so keys added since then count at their defaults; placement keys `run_dir`, `ray_*`, `compare`
are ignored, and so are `embed` and `sid`, which reach an arm run only through the hashed SID
map and codebooks) and the shared hashes are equal; otherwise it says why and reruns. Commit the
records folder and a multi-hour CPU comparison can span sessions. `--report-only` rebuilds the
report from finished runs and records without running anything.

What it does not know: what the stages compute; it only prepares configs and run folders,
drives `gti.pipeline`, and hands the finished runs to `gti.diagnostics.report_files`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from gti import config as C
from gti import pipeline
from gti.config_io import apply_overrides
from gti.errors import GtiError
from gti.experiments.records import (
    load_record, read_record, record_path, records_dir, run_facts, shared_identity, write_record,
)
from gti.experiments.shared_stages import SHARED_STAGES, ArmRun, CompareError, adopt_shared, slug
from gti.files import atomic_write_json
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


def arm_config(cfg: C.RunConfig, arm: str, seed: int, run_dir: Path) -> C.RunConfig:
    """The validated config of one arm x seed run in `run_dir`."""
    raw = cfg.model_dump(mode="json")
    ov = arm_overrides(cfg, arm) + [f"seed={seed}", f"run_dir={run_dir}"]
    return C.validate(apply_overrides(raw, ov), f"arm '{arm}' seed {seed}")


def plan(cfg: C.RunConfig, arms: Sequence[str], n_seeds: int | str | Mapping[str, int], out: Path) -> list[ArmRun]:
    """All arm x seed runs, seed-major (every arm of seed s before any arm of seed s+1; an arm
    with fewer seeds, `parse_seeds`, drops out after its last), with their configs and run
    folders. Seed-major so that a comparison stopped part-way (a long CPU run spans sessions)
    always holds complete, paired seeds to report on."""
    counts = parse_seeds(n_seeds, arms)
    runs = []
    for seed in seeds_for(cfg, max(counts.values())):
        for arm in arms:
            if seed - cfg.seed < counts[arm]:
                rd = out / "runs" / slug(arm) / f"seed{seed}"
                runs.append(ArmRun(arm, seed, rd, arm_config(cfg, arm, seed, rd)))
    return runs


# --------------------------------------------------------------------------- shared stages
def shared_config(cfg: C.RunConfig, out: Path) -> C.RunConfig:
    return C.validate(apply_overrides(cfg.model_dump(mode="json"), [f"run_dir={out / 'shared'}"]))


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
) -> dict[tuple[str, int], str]:
    """Run every arm x seed; returns {(arm, seed): error text} for the runs that failed.
    `on_done(run)` is called as soon as each run has finished (the record is kept then, so a
    session that ends mid-comparison loses only the run in progress)."""
    failures: dict[tuple[str, int], str] = {}
    width = 1
    if cfg.compare.parallel and len(runs) > 1:
        from gti.ray_start import ensure_ray

        ensure_ray(cfg)
        import ray

        width = cfg.compare.max_parallel or auto_parallel(cfg, ray.cluster_resources())
    if width <= 1:
        for r in runs:
            echo(f"{r.arm} seed {r.seed}: running in {r.run_dir}")
            try:
                info = run_arm(r.cfg.model_dump(mode="json"))
                echo(f"{r.arm} seed {r.seed}: {'up to date' if info['skipped'] else 'done'}")
                on_done(r)
            except Exception as err:  # one failed arm must not lose the others
                failures[(r.arm, r.seed)] = _describe(err)
                echo(f"{r.arm} seed {r.seed}: FAILED: {failures[(r.arm, r.seed)].splitlines()[0]}")
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
            echo(f"{r.arm} seed {r.seed}: submitted ({r.run_dir})")
            ref = task.remote(r.cfg.model_dump(mode="json"), os.getcwd())
            pending[ref], deadline[ref] = r, time.monotonic() + cfg.compare.arm_timeout_s
        wait_s = max(0.0, min(min(deadline.values()) - time.monotonic(), WAIT_POLL_S))
        done, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
        if not done:
            for ref in [ref for ref, t in deadline.items() if t <= time.monotonic()]:
                r = pending.pop(ref)
                del deadline[ref]
                ray.cancel(ref, force=True)  # its worker (and the Train run it drives) goes with it
                failures[(r.arm, r.seed)] = (f"compare.arm_timeout_s: not finished {cfg.compare.arm_timeout_s:g}s "
                                             "after its submission, cancelled (raise it for longer arm runs)")
                echo(f"{r.arm} seed {r.seed}: FAILED: {failures[(r.arm, r.seed)]}")
            continue
        r = pending.pop(done[0])
        del deadline[done[0]]
        try:
            info = ray.get(done[0])
            echo(f"{r.arm} seed {r.seed}: {'up to date' if info['skipped'] else 'done in %.0fs' % info['seconds']}")
            on_done(r)
        except Exception as err:
            cause = getattr(err, "cause", None) or err
            failures[(r.arm, r.seed)] = _describe(cause)
            echo(f"{r.arm} seed {r.seed}: FAILED: {failures[(r.arm, r.seed)].splitlines()[0]}")
    return failures


def _describe(err: BaseException) -> str:
    if isinstance(err, GtiError):
        return str(err)
    return f"{type(err).__name__}: {err}\n" + "".join(traceback.format_exception(err))


def write_report(
    runs: Sequence[ArmRun], cfg: C.RunConfig, out: Path, title: str,
    stored: dict[tuple[str, int], tuple[Any, dict[str, Any]]] | None = None,
) -> dict[str, Path]:
    """The cross-arm report over the finished runs and the stored records standing for runs
    not here (`stored`: {(arm, seed): (RunRecord, run facts)}), in plan order: spectra per
    phase, SFT learning curves, heat maps per arm (from runs whose folders are here)."""
    from gti.diagnostics.report_files import build_report, learning_curve_plots, spectra_plots

    stored = stored or {}
    done = [r for r in runs if (r.run_dir / "report" / "_manifest.json").is_file()]
    done_keys = {(r.arm, r.seed) for r in done}
    records, facts = [], []
    for r in runs:
        if (r.arm, r.seed) in done_keys:
            records.append(load_record(r))
            facts.append(run_facts(r))
        elif (r.arm, r.seed) in stored:
            records.append(stored[(r.arm, r.seed)][0])
            facts.append(stored[(r.arm, r.seed)][1])
    if not records:
        raise CompareError(f"no finished arm runs under {out / 'runs'} (nor records) to report on")
    plot_dir = out / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    plots = dict(spectra_plots(records, plot_dir))
    plots.update(learning_curve_plots(records, plot_dir))
    for arm in dict.fromkeys(r.arm for r in done):
        first = next(r for r in done if r.arm == arm)
        for name, caption in (("sid_sid_init", "SID-SID cosine at init"),
                              ("sid_sid_sft", "SID-SID cosine after SFT"),
                              ("sid_text_sft", "SID-text cosine after SFT")):
            src = first.run_dir / "report" / "plots" / f"{name}.png"
            if src.is_file():
                dst = plot_dir / f"{slug(arm)}_seed{first.seed}_{name}.png"
                shutil.copyfile(src, dst)
                plots[f"{arm} (seed {first.seed}): {caption}"] = dst
    return build_report(
        records, out, plots=plots, title=title, baseline_arm=cfg.report.baseline_arm,
        n_boot=cfg.report.bootstrap, seed=cfg.seed, run_facts=facts,
    )


# --------------------------------------------------------------------------- entry points
def compare(
    cfg: C.RunConfig, arms: Sequence[str], n_seeds: int | str | Mapping[str, int],
    out: str | Path | None = None, echo: Callable[[str], None] = _echo, report_only: bool = False,
) -> dict[str, Path]:
    """Shared stages once, every arm x seed (or its stored record), one report; returns the
    report paths. `report_only`: run nothing, report on what is finished or recorded. A run
    (not `report_only`, a reader) holds `out`'s writer lock (`gti.runlock`) throughout."""
    from contextlib import nullcontext

    from gti.runlock import RunLock

    arms = parse_arms(list(arms))
    out = Path(out).expanduser().resolve() if out else cfg.resolved_run_dir() / "compare"
    with nullcontext() if report_only else RunLock(out):
        return _compare(cfg, arms, n_seeds, out, echo, report_only)


def _compare(cfg: C.RunConfig, arms: list[str], n_seeds, out: Path, echo: Callable[[str], None],
             report_only: bool) -> dict[str, Path]:
    runs = plan(cfg, arms, n_seeds, out)  # validates every arm config before any work
    shared = shared_config(cfg, out)
    shared_dir = shared.resolved_run_dir()
    if report_only:
        missing = [s for s in SHARED_STAGES if not (shared_dir / s / "_manifest.json").is_file()]
        if missing:
            raise CompareError(f"--report-only: shared stage(s) {', '.join(missing)} not run in {shared_dir}")
    else:
        echo(f"shared stages ({', '.join(SHARED_STAGES)}) in {shared_dir}")
        pipeline.run(shared, to_stage=SHARED_STAGES[-1], echo=echo)
    identity = shared_identity(shared_dir)
    rdir = records_dir(cfg, out)
    todo, stored, complete = [], {}, set()
    for r in runs:
        if first_incomplete(r.cfg, r.run_dir) is None:
            complete.add((r.arm, r.seed))
        else:
            rec, facts, why = read_record(r, rdir, identity)
            if rec is not None:
                stored[(r.arm, r.seed)] = (rec, facts)
                echo(f"{r.arm} seed {r.seed}: finished earlier, taken from {record_path(rdir, r.arm, r.seed)}")
                continue
            if why:
                echo(f"{r.arm} seed {r.seed}: record not used, the run goes again: {why}")
        todo.append(r)
    if not report_only:
        # Only into runs that still have stages to run: re-linking the shared stages into a
        # finished run (e.g. one left from an earlier session, whose shared folder has been
        # rebuilt since) would make its ground stage look stale and run the whole arm again.
        for r in todo:
            if (r.arm, r.seed) not in complete:
                adopt_shared(shared_dir, r.run_dir)
    atomic_write_json(out / "compare.json", {
        "arms": {a: arm_overrides(cfg, a) for a in arms},
        "seeds": {a: seeds_for(cfg, n) for a, n in parse_seeds(n_seeds, arms).items()},
        "equal_budget": cfg.compare.equal_budget,
        "shared_run_dir": str(shared_dir),
        "shared_identity": identity,
        "records_dir": str(rdir),
        "runs": [{"arm": r.arm, "seed": r.seed, "run_dir": str(r.run_dir),
                  "from_record": (r.arm, r.seed) in stored} for r in runs],
    })

    def keep(r: ArmRun) -> None:
        try:
            echo(f"{r.arm} seed {r.seed}: record kept in {write_record(r, rdir, identity)}")
        except (OSError, GtiError) as err:  # the run itself is fine; say so and go on
            echo(f"{r.arm} seed {r.seed}: could not keep its record: {err}")

    if report_only:  # a run with a report stands as made (even by older code): keep it
        failures = {}
        for r in todo:
            if (r.run_dir / "report" / "_manifest.json").is_file():
                keep(r)
    else:
        failures = execute(todo, cfg, echo, on_done=keep)
    ok = [r for r in runs if (r.arm, r.seed) not in failures]
    counts = parse_seeds(n_seeds, arms)
    title = f"gti comparison: {', '.join(f'{a} x {counts[a]}' for a in arms)} seed(s)"
    paths = write_report(ok, cfg, out, title, stored) if ok else {}
    if failures:
        for (arm, seed), msg in failures.items():
            print(f"--- {arm} seed {seed} failed:\n{msg}", file=sys.stderr)
        names = ", ".join(f"{a}/seed{s}" for a, s in failures)
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
    paths = compare(cfg, arms, n_seeds, getattr(args, "out", None),
                    report_only=bool(getattr(args, "report_only", False)))
    print(paths["html"])
    return 0
