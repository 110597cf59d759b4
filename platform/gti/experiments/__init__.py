"""Experiments: drivers above the pipeline that run it many times (`gti compare`, `gti tune`).

They prepare configs and run folders and call the pipeline's entry points (`gti.run.pipeline.run`,
`gti.run.pipeline.run_detached`); they never build a stage context themselves.
"""
