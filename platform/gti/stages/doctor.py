"""`gti doctor` and the preflight `gti run` starts with: reading the cluster, then the checks.

What it is for: filling `gti.preflight.Facts` with the resources of the Ray cluster a run will
use, without reserving any: with no `ray_address` (and no RAY_ADDRESS) it is the local Ray that
`ensure_ray` would start (ray_num_cpus, the visible GPUs) and Ray is not started at all; with
one, it joins the cluster as a driver (no tasks, no placement groups), reads
`ray.cluster_resources()`, and stays joined for the stages that follow (`gti doctor` leaves it
again). If this process already runs a Ray, its resources are used as they are.

What it does not know: the checks themselves (gti.preflight).
"""

from __future__ import annotations

import sys

from gti import config as C
from gti import preflight


def read_cluster(cfg: C.RunConfig) -> tuple[dict[str, float] | None, str, str | None, bool]:
    """(resources or None for the local machine, where they come from, error line, remote)."""
    address = cfg.requested_ray_address()
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            return dict(ray.cluster_resources()), "the running Ray", None, bool(address)
    if not address:
        return None, "this machine", None, False
    import ray

    from gti.stages._ray import ensure_ray

    try:
        ensure_ray(cfg)  # joins as a driver, exactly as the stages will
    except Exception as err:  # noqa: BLE001 - one line naming the key
        first = (str(err).strip() or type(err).__name__).splitlines()[0]
        hint = ("; set RAY_AUTH_MODE=token and the cluster's token (README 'How the auth token reaches clients')"
                if "authentication" in first.lower() or "token" in first.lower() else "")
        return {}, f"cluster at {address}", f"ray_address {address}: cannot join the cluster: {first}{hint}", True
    return dict(ray.cluster_resources()), f"cluster at {address}", None, True


def run_checks(cfg: C.RunConfig) -> list[preflight.Check]:
    cluster, source, error, remote = read_cluster(cfg)
    facts = preflight.gather_facts(cfg, cluster, source, error, remote)
    return preflight.checks(cfg, facts)


def preflight_or_raise(cfg: C.RunConfig) -> None:
    """What `gti run` does first: PreflightError (one line, exit 2) on the first problem;
    warnings are printed and the run goes on."""
    results = run_checks(cfg)
    for c in results:
        if c.status == preflight.WARN:
            print(f"gti: warning: {c.name}: {c.detail}", file=sys.stderr, flush=True)
    preflight.raise_on_error(results)


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
