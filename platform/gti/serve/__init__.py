"""`gti serve`: the recommender of a finished run behind HTTP.

`service` (one loaded run answering batches of histories in one constrained beam search),
`reload` (which version is served, and swapping in a newer one), `app` (the FastAPI app:
endpoints, request limits, the bearer token) and `deployment` (the Ray Serve shell). `gti infer`,
the same decode offline for many users: `infer` (users, parts, atomic part files, resume) and
`infer_ray` (the Ray Data actor pool). `deployment` and `infer_ray` are the only modules here
that import ray.
"""
