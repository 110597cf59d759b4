"""`gti doctor` and the preflight each command that asks Ray for resources starts with.

What it is for: filling `gti.preflight.Facts` with the resources of the Ray cluster a run will
use, without reserving any (`read_cluster`), and each command's part of the preflight
(`for_refresh`, `for_tune`, `for_vocab_ground`, `for_serve`, and
`gti.experiments.compare.preflight` through `preflight_each`; `gti run` / `gti stage` check the
whole config): the config as that command uses it and the stages it runs, so a command that
would wait for ever for GPUs or CPUs the cluster lacks stops at once with one line instead.

What it does not know: the checks themselves (gti.preflight), what the commands then do.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from gti import config as C
from gti import preflight


def read_cluster(cfg: C.RunConfig) -> tuple[dict[str, float] | None, str, str | None, bool]:
    """(resources or None for the local machine, where they come from, error line, remote).

    With no `ray_address` (and no RAY_ADDRESS) it is the local Ray that `ensure_ray` would start
    (ray_num_cpus, the visible GPUs) and Ray is not started at all; with one, it joins the
    cluster as a driver (no tasks, no placement groups), reads `ray.cluster_resources()`, and
    stays joined for the stages that follow (`gti doctor` leaves it again). If this process
    already runs a Ray, its resources are used as they are."""
    address = cfg.requested_ray_address()
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            return dict(ray.cluster_resources()), "the running Ray", None, bool(address)
    if not address:
        return None, "this machine", None, False
    import ray

    from gti.ray_start import ensure_ray

    try:
        ensure_ray(cfg)  # joins as a driver, exactly as the stages will
    except Exception as err:  # noqa: BLE001 - one line naming the key
        first = (str(err).strip() or type(err).__name__).splitlines()[0]
        hint = ("; set RAY_AUTH_MODE=token and the cluster's token (docs/scaling.md 'How the auth token reaches clients')"
                if "authentication" in first.lower() or "token" in first.lower() else "")
        return {}, f"cluster at {address}", f"ray_address {address}: cannot join the cluster: {first}{hint}", True
    return dict(ray.cluster_resources()), f"cluster at {address}", None, True


def run_checks(cfg: C.RunConfig, stages: Sequence[str] = preflight.PIPELINE,
               only: Sequence[str] | None = None) -> list[preflight.Check]:
    """The checks for the `stages` a command runs; `only`: the names of those that apply to it
    (the part before any ':'), None for all."""
    cluster, source, error, remote = read_cluster(cfg)
    facts = preflight.gather_facts(cfg, cluster, source, error, remote)
    results = preflight.checks(cfg, facts, stages)
    return results if only is None else [c for c in results if c.name.split(":")[0] in only]


def preflight_or_raise(cfg: C.RunConfig, stages: Sequence[str] = preflight.PIPELINE,
                       only: Sequence[str] | None = None) -> None:
    """What `gti run` does first: PreflightError (one line, exit 2) on the first problem;
    warnings are printed and the run goes on."""
    _report(run_checks(cfg, stages, only))


def _report(results: list[preflight.Check]) -> None:
    for c in dict.fromkeys((c.name, c.detail) for c in results if c.status == preflight.WARN):
        print(f"gti: warning: {c[0]}: {c[1]}", file=sys.stderr, flush=True)
    preflight.raise_on_error(results)


# --------------------------------------------------------------------------- each command's part
SERVE_CHECKS = ("cluster", "resources", "torch build", "ray auth")  # replicas load the run's own model
REFRESH_CHECKS = ("cluster", "resources", "torch build", "bf16", "backend", "deepspeed", "encoder", "disk",
                  "ray auth", "tracking")  # it trains the run's own model, not model.name
# No embedding encoder, no tracking; --model is checked by gti vocab ground itself, after --out.
VOCAB_CHECKS = ("cluster", "resources", "torch build", "bf16", "backend", "deepspeed", "disk", "ray auth")


def for_refresh(args) -> None:
    """`gti refresh`: the run's config (with the overrides) as the refresh trains it:
    `refresh.ground_steps` grounding and `refresh.sft_steps` SFT steps (with --interactions) on
    the run's workers and `use_gpu` (gti.refresh.train). Its embed step runs in this process,
    and it continues from the run's own model (no model.name check)."""
    from gti.refresh.attempt import load_run_config

    run_dir = Path(args.run_dir).expanduser().resolve()
    if not run_dir.is_dir():
        return  # gti refresh says so, in its own line
    cfg = load_run_config(run_dir, args.items, args.interactions, list(args.overrides or []))
    ground = cfg.ground.model_copy(update={"steps": cfg.refresh.ground_steps})
    sft = cfg.sft.model_copy(update={"steps": cfg.refresh.sft_steps if args.interactions else 0})
    preflight_or_raise(cfg.model_copy(update={"ground": ground, "sft": sft}), ("ground", "sft"), REFRESH_CHECKS)


def for_tune(args) -> None:
    """`gti tune`: the stages before grounding (run once), then every trial's grounding, and with
    `tune.objective: sft` its SFT and evaluation."""
    cfg = C.load(args.config, list(args.overrides or []))
    trials = ("ground", "sft", "rl", "evaluate") if cfg.tune.objective == "sft" else ("ground",)
    preflight_or_raise(cfg, ("embed", "sid") + trials)


def preflight_each(configs: dict[str, C.RunConfig]) -> None:
    """The checks of several configs of one command (`gti compare`'s arms, {label: config}):
    each warning once, the first problem's line prefixed with its label."""
    results = []
    for label, cfg in configs.items():
        results += [c if c.status != preflight.ERROR else preflight.Check(c.name, c.status, f"{label}: {c.detail}")
                    for c in run_checks(cfg)]
    _report(results)


def for_vocab_ground(args) -> None:
    """`gti vocab ground`: the grounding of the new rows (`ground` of its config) on --model,
    writing to --out."""
    from gti.vocab_ground import load_config

    run_cfg = load_config(args.config, getattr(args, "overrides", None)).run_config(args.model)
    preflight_or_raise(run_cfg.model_copy(update={"run_dir": str(Path(args.out).expanduser())}), ("ground",),
                       VOCAB_CHECKS)


def for_serve(args) -> None:
    """`gti serve`: the replicas the `serve:` settings ask for, on the local Ray (every core,
    the visible GPUs) or the cluster at --ray-address."""
    from gti.serve.deployment import serve_config

    cfg = C.RunConfig(ray_address=getattr(args, "ray_address", None), serve=serve_config(args))
    preflight_or_raise(cfg, ("serve",), SERVE_CHECKS)


def cli_main(args) -> int:
    """`gti doctor [--config X] [key=value ...]`: the table; exit 2 if any check failed."""
    cfg = C.load(args.config, list(args.overrides or []))
    joined = "ray" in sys.modules and __import__("ray").is_initialized()
    results = run_checks(cfg)
    if not joined and "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()  # only the driver connection doctor made; the cluster keeps running
    print(preflight.table(results))
    bad = preflight.errors(results)
    if bad:
        for c in bad:
            print(f"gti: error: {c.detail}", file=sys.stderr)
        return 2
    print(f"{len(results)} checks: no problems" + (
        f" ({sum(c.status == preflight.WARN for c in results)} warning(s))"
        if any(c.status == preflight.WARN for c in results) else ""))
    return 0
