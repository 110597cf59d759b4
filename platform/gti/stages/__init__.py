"""Stage modules: the Ray shell around the pure building blocks, one module per pipeline stage.

Each module exposes `run(ctx: gti.run.contract.StageContext) -> gti.run.contract.StageResult` and may
expose `input_fingerprints(cfg) -> dict[str, str]` for files it reads from outside the run dir.
A stage imports the contract, never the pipeline or another stage, and no module of the package
imports a stage (the pipeline names them in `gti.run.pipeline.STAGES`): what a stage shares with
other code lives below it (`gti.ray_start` to start or join Ray, `gti.run.chunked_output`, the
contract files' schemas in `gti.data.schemas`, the blocks of `gti.data`, `gti.lm`, `gti.eval`).
"""
