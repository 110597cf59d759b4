"""Stage modules: the Ray shell around the pure building blocks.

Each module exposes `run(ctx: gti.contract.StageContext) -> gti.contract.StageResult` and may
expose `input_fingerprints(cfg) -> dict[str, str]` for files it reads from outside the run dir.
A stage imports the contract, never the pipeline or another stage; `_ray.py` (starting or
joining Ray) and `_chunks.py` (resumable chunked output) are the stages' shared infrastructure.
With `gti.experiments` and `gti.train.driver` these are the only modules that import ray.
"""
