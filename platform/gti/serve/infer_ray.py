"""`gti infer`: offline batch inference of a finished run on a Ray Data actor pool (the Ray half).

What it is for: `cli_main` is `gti infer --run-dir R --users all|FILE --k K --out OUT`. It plans
the job (`gti.serve.infer.plan_job`), holds `RunLock(OUT)` (two jobs never write one output; the
run folder is only read, without its lock), skips the parts a killed attempt finished, and
decodes the rest on a pool of `PartDecoder` actors, or, for a small catalog, on one in this
process (`decode_here`). Each decoder writes its part files itself, so the rows never pass
through the driver; `DecoderRoll` makes sure no decoder can still write a part once the lock is
released.

What it does NOT know: how parts are planned, written or checked (`gti.serve.infer`), or how a
history is decoded (`gti.serve.service`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import ray

from gti.common.errors import ConfigError, GtiError
from gti.serve import infer as I

_on_part = None  # test hook: called with each part index the driver sees written (e.g. to interrupt)


class PartDecoder:
    """`map_batches` callable class: rows (part, user_id list, history list) -> one part file
    written per row; returns (part, rows, errors, seconds) per row. It loads the run once
    (`RecommenderService.load`, the loader of `gti serve`) and checks that it holds the planned
    map; a pool decoder first registers itself on the job's `DecoderRoll`."""

    def __init__(self, run_dir: str, version: int, map_hash: str, out: str, k: int, exclude_history: bool,
                 batch_users: int, num_gpus: float = 0.0, cpu_threads: int | None = None,
                 trust_remote_code: bool = False, model: dict | None = None, roll: str | None = None) -> None:
        import torch

        from gti.serve.service import RecommenderService

        if roll is not None:  # first: a decoder stopped while it loads is waited for too
            register(roll)
        device = "cuda" if num_gpus > 0 and torch.cuda.is_available() else "cpu"
        if device == "cpu":
            from gti.common.devices import use_cpu_threads

            use_cpu_threads(cpu_threads)
        self.svc = RecommenderService.load(run_dir, version, device=device, trust_remote_code=trust_remote_code)
        if self.svc.map_hash != map_hash:
            raise GtiError(f"{run_dir} v{version}: the actor loaded SID map {self.svc.map_hash}, the job planned "
                           f"{map_hash}; rerun gti infer")
        # A `gti run --from sft` finishing between the plan and this load: parts of that other
        # model would be written under the planned model's key.
        got = I.model_fingerprint(Path(run_dir), str(self.svc.run.model_stage)) if model is not None else None
        if got is not None and got != model:
            raise GtiError(f"{run_dir} v{version}: the model changed since the job was planned (fingerprint "
                           f"{model.get('model_fingerprint')} -> {got['model_fingerprint']}); rerun gti infer")
        self.out, self.k, self.exclude, self.batch_users = Path(out), k, exclude_history, batch_users

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows: dict[str, list] = {"part": [], "rows": [], "errors": [], "seconds": []}
        for part, users, hists in zip(*(batch.column(c).to_pylist() for c in ("part", "user_id", "history"))):
            t0 = time.perf_counter()
            table = I.decode_part(self.svc, users, hists, k=self.k, exclude_history=self.exclude,
                                  batch_users=self.batch_users)
            I.write_part(self.out, part, table)
            rows["part"].append(part)
            rows["rows"].append(table.num_rows)
            rows["errors"].append(table.num_rows - table.column("error").null_count)
            rows["seconds"].append(time.perf_counter() - t0)
        return pa.table(rows)


def part_rows_table(job: I.InferJob, part: I.Part) -> pa.Table:
    """One dataset row for `part`: part, user_id list<str>, history list<list<str>>."""
    sl = job.users.slice(part.start, part.rows)
    return sl.select(pl.col("user_id").implode(), pl.col("history").implode()).with_columns(
        part=pl.lit(part.index, pl.Int64)).to_arrow()


def _model(job: I.InferJob) -> dict:
    return {name: job.key[name] for name in ("model_fingerprint", "model_created")}


def _pool(job: I.InferJob, todo: list[I.Part], concurrency: int, num_gpus: float, trust_remote_code: bool,
          roll: str | None = None):
    """The Ray Dataset of the `todo` parts (one block each) mapped by a pool of `PartDecoder`s
    (each registered with the `DecoderRoll` named `roll`)."""
    return ray.data.from_arrow([part_rows_table(job, p) for p in todo]).map_batches(
        PartDecoder,
        fn_constructor_kwargs=dict(
            run_dir=str(job.run_dir), version=job.version, map_hash=job.key["map_hash"], out=str(job.out),
            k=job.key["k"], exclude_history=job.key["exclude_history"], batch_users=job.key["batch_users"],
            num_gpus=num_gpus, cpu_threads=job.eval_cfg.cpu_threads, trust_remote_code=trust_remote_code,
            model=_model(job), roll=roll),
        batch_size=1,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=max(1, min(concurrency, len(todo)))),
        num_gpus=num_gpus or None,
    )


def _decoded_here(job: I.InferJob, todo: list[I.Part], trust_remote_code: bool):
    """The parts' summaries, decoded one after the other by one `PartDecoder` in this process
    (a small catalog: see `decode_here`)."""
    dec = PartDecoder(str(job.run_dir), job.version, job.key["map_hash"], str(job.out), job.key["k"],
                      job.key["exclude_history"], job.key["batch_users"], cpu_threads=job.eval_cfg.cpu_threads,
                      trust_remote_code=trust_remote_code, model=_model(job))
    for part in todo:
        yield dec(part_rows_table(job, part))


def decode_here(job: I.InferJob, concurrency: int | None, num_gpus: float) -> bool:
    """As the evaluate stage decides (`gti.stages.evaluate`): a catalog of at most the run's
    `local_max_items` items, one CPU decoder and no `--concurrency` asking for a pool -> decode
    in this process, without an actor pool whose start-up costs more than the work there."""
    from gti.run.manifest import Manifest

    if concurrency is not None or job.eval_cfg.concurrency != 1 or num_gpus:
        return False
    n_items = int(Manifest.read(Path(job.run_dir) / "sid").facts["n_items"])
    return n_items <= _ray_config(job, None).local_max_items


# --------------------------------------------------------------------------- stopping the decoders
ROLL_NAMESPACE = "gti-infer"
STOP_WAIT_S = 120.0  # a killed actor exits in well under a second; this bounds a lost node


@ray.remote(num_cpus=0)
class _Roll:
    """The decoders of one job, as each registered itself: (actor handle, node id, pid)."""

    def __init__(self) -> None:
        self._members: list[tuple] = []

    def add(self, member: tuple) -> None:
        self._members.append(member)

    def members(self) -> list[tuple]:
        return list(self._members)


def register(roll: str) -> None:
    """Called by a `PartDecoder` on its actor: put itself on the job's roll (before it can write)."""
    import os

    ctx = ray.get_runtime_context()
    ray.get(ray.get_actor(roll, namespace=ROLL_NAMESPACE).add.remote(
        (ctx.current_actor, ctx.get_node_id(), os.getpid())))


def _pid_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process now holds the number: ours is gone
        return False
    return True


def _exited(member: tuple, here: str) -> bool:
    """Whether a killed decoder is gone: Ray reports its actor dead and, on this node, its
    process no longer exists (Ray marks an actor dead before its process has quit)."""
    handle, node, pid = member
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=1.0)
        return False  # still answering
    except ray.exceptions.GetTimeoutError:
        return False  # busy in a decode the kill has not reached yet
    except ray.exceptions.RayActorError:
        pass
    return node != here or not _pid_alive(pid)


def wait_exited(members: list, timeout_s: float, log, *, kill=None, exited=None, sleep=time.sleep) -> list:
    """Kill each member and return once every one has exited (`exited(member)`), or after
    `timeout_s` (one log line naming those left). A Ctrl-C meanwhile does not cut the wait
    short: the output lock is released after it. -> the members not seen to exit."""
    kill = kill or (lambda m: ray.kill(m[0], no_restart=True))
    if exited is None:
        here = ray.get_runtime_context().get_node_id()
        exited = lambda m: _exited(m, here)  # noqa: E731
    to_kill, left, deadline = list(members), list(members), time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        try:
            while to_kill:
                kill(to_kill[0])
                to_kill.pop(0)
            left = [m for m in left if not exited(m)]
            if left:
                sleep(0.1)
        except KeyboardInterrupt:
            log(f"stopping: waiting for {len(left)} decoder(s) to exit before the output is unlocked")
    if left:
        log(f"{len(left)} decoder(s) not seen to exit within {timeout_s:.0f} s (pids "
            f"{', '.join(str(m[2]) for m in left[:8])}); the output is unlocked anyway")
    return left


class DecoderRoll:
    """The decoder actors of one `gti infer` pool: each `PartDecoder` registers itself (a named
    actor of the job, `roll`) before it can write a part; `stop()` kills them all and waits until
    each has exited. Ray Data's own shutdown kills without waiting, or lets an actor finish its
    part: either way a part could land in `--out` after its run lock is released."""

    def __init__(self, actor, name: str) -> None:
        self.actor, self.name = actor, name

    @classmethod
    def start(cls) -> "DecoderRoll":
        import uuid

        name = f"roll-{uuid.uuid4().hex[:12]}"
        return cls(_Roll.options(name=name, namespace=ROLL_NAMESPACE).remote(), name)

    def stop(self, log, timeout_s: float = STOP_WAIT_S) -> list:
        """Kill every registered decoder and wait for each to exit (`wait_exited`), then the roll."""
        members: list = []
        for _ in range(3):  # a Ctrl-C during this small call: ask again
            try:
                members = ray.get(self.actor.members.remote())
                break
            except KeyboardInterrupt:
                continue
        left = wait_exited(members, timeout_s, log)
        ray.kill(self.actor)
        return left


def run_parts(job: I.InferJob, todo: list[I.Part], done_rows: int, *, concurrency: int, num_gpus: float,
              trust_remote_code: bool = False, log=None, here: bool = False) -> dict[str, Any]:
    """Decode and write the `todo` parts (`here`: in this process, else on an actor pool of
    `concurrency`, `eval.concurrency` of the run's config or `--concurrency`, `eval.num_gpus`
    GPUs each); -> {decoded_users, error_rows, seconds, users_per_s}. Progress is drawn in users
    from the parts' small summaries. However it ends (done, an error, Ctrl-C), it kills the pool's
    decoders and waits until each has exited (`DecoderRoll.stop`) before it returns, so the
    lock on OUT is released only when no decoder can still write a part there."""
    from gti.common.progress import Progress

    t0, n, errors = time.time(), 0, 0
    bar = Progress(job.users.height, "infer", "users", initial=done_rows, log=log)
    roll = None if here else DecoderRoll.start()
    batches = (_decoded_here(job, todo, trust_remote_code) if here else
               iter(_pool(job, todo, concurrency, num_gpus, trust_remote_code, roll.name).iter_batches(
                   batch_size=None, batch_format="pyarrow")))
    try:
        for batch in batches:
            for part, rows, errs in zip(*(batch.column(c).to_pylist() for c in ("part", "rows", "errors"))):
                n, errors = n + rows, errors + errs
                bar.update(rows)
                if _on_part is not None:
                    _on_part(part)
    finally:
        # The caller releases the output's run lock when this returns: no decoder may still be
        # writing a part then. Closing the generator shuts the executor down, which drops its
        # actors (one mid-part finishes it and writes) or kills them without waiting; the roll
        # kills every decoder that registered and returns once each one has exited.
        try:
            batches.close()
        finally:
            if roll is not None:
                roll.stop(log=log)
            bar.close()
    secs = time.time() - t0
    return {"decoded_users": n, "error_rows": errors, "seconds": round(secs, 2),
            "users_per_s": round(n / max(secs, 1e-9), 2)}


def _ray_config(job: I.InferJob, address: str | None):
    """The run's config (its ray_address and ray_num_cpus), `--ray-address` first."""
    from gti.run.loaded import run_config

    cfg = run_config(job.run_dir, job.key["model"])
    return cfg.model_copy(update={"ray_address": address}) if address else cfg


def cli_main(args) -> int:
    """`gti infer` (see the module docstring); at the end marks the manifest complete and prints
    one summary line."""
    from gti.run.runlock import RunLock
    from gti.ray_start import ensure_ray

    log = lambda m: print(f"gti infer: {m}", file=sys.stderr, flush=True)  # noqa: E731
    job = I.plan_job(args.run_dir, args.users, args.out, k=int(args.k), version=args.version,
                     exclude_history=bool(args.exclude_history), part_rows=args.part_rows,
                     batch_users=args.batch_users)
    ec = job.eval_cfg
    concurrency = int(ec.concurrency if args.concurrency is None else args.concurrency)
    if concurrency < 1:
        raise ConfigError(f"--concurrency must be >= 1, got {concurrency}")
    num_gpus = float(ec.num_gpus if args.num_gpus is None else args.num_gpus)
    here = decode_here(job, args.concurrency, num_gpus)
    with RunLock(job.out, what="gti infer"):
        resumed = I.prepare_out(job.out, job.key, force=bool(args.force)) is not None
        done = I.finished_parts(job.out, job.users, job.parts)
        todo = [p for p in job.parts if p.index not in done]
        done_rows = sum(p.rows for p in job.parts if p.index in done)
        if resumed and done:
            log(f"resuming: {len(done)} of {len(job.parts)} part(s) ({done_rows:,} users) already written")
        stats = {"decoded_users": 0, "error_rows": 0, "seconds": 0.0, "users_per_s": 0.0}
        if todo:
            if here:
                log("the catalog is at most local_max_items: decoded in this process (--concurrency N: a pool)")
            else:
                ensure_ray(_ray_config(job, getattr(args, "ray_address", None)))
            stats = run_parts(job, todo, done_rows, concurrency=concurrency, num_gpus=num_gpus, here=here,
                              trust_remote_code=bool(getattr(args, "trust_remote_code", False)), log=log)
        I.finish_manifest(job.out, job.key, job.parts, {**stats, "resumed_parts": len(done)})
    errs = f", {stats['error_rows']:,} without items (see the error column)" if stats["error_rows"] else ""
    log(f"{job.users.height:,} users -> {job.out} ({len(job.parts)} part(s), {len(done)} resumed; "
        f"{stats['users_per_s']:,} users/s); model {job.key['model']}, map {job.key['map_hash'][:12]}{errs}")
    return 0
