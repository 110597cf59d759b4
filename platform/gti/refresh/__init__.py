"""`gti refresh`: new items onto a trained run, without retraining it.

What it is for: `refresh(run_dir, items, interactions)` (`gti.refresh.command`) gives items a
catalog gained after the run trained SIDs made of the run's code tokens (adding a few where a
prefix group is full), grounds them with a short pass from the run's model, and writes
`<run>/refresh/v<k>/`: a SID-map version descending from the run's, and a model that serves it.
Modules: `attempt` (what the steps share), `ingest`, `new_items`, `tokens`, `train` (the steps),
`command` (their order, resuming, export, publishing; `cli_main`). The steps, outputs, versions
and keys: docs/refresh.md; what it imports (no stage module; Ray only through
`gti.ray_start.ensure_ray` and the training runners): docs/ARCHITECTURE.md.

What it does not know: how the run's stages were run (it reads their manifests and outputs).
"""
