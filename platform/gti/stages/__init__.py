"""Stage modules: the Ray shell around the pure building blocks.

Each module exposes `run(ctx: gti.pipeline.StageContext) -> gti.pipeline.StageResult` and may
expose `input_fingerprints(cfg) -> dict[str, str]` for files it reads from outside the run dir.
These are the only modules (with `gti.train.loop`) that import ray.
"""
