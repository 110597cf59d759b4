"""The `serve:` section of the run config: how `gti serve` runs the recommender online.

What it is for: `ServeConfig`, every setting of the service (where it listens and the path it is
mounted at, replicas and threads per replica, autoscaling bounds, request batching, request
limits, what to do with unknown item ids, whether every endpoint needs the bearer token).
`gti.config.RunConfig` holds it as `serve`; it enters no stage's fingerprint.

What it does NOT know: the token itself (only the NAME of the environment variable holding
it: a secret never lives in a config file), the run being served, FastAPI or Ray. It never
imports ray or torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from gti.config_io import StrictModel

MAX_K_LIMIT = 1000  # as gti.eval.recommend.MAX_K (not imported: config sits below eval)


# serve.batch_wait_timeout_s when unset: a CPU decode takes seconds, so waiting 0.25 s lets the
# clients of the last batch (answered together) join the next one; a GPU decode takes milliseconds.
DEFAULT_BATCH_WAIT_S = {"cpu": 0.25, "gpu": 0.01}


class ServeConfig(StrictModel):
    """`gti serve` (gti/serve/): a Ray Serve application over one loaded run."""

    host: str = Field("127.0.0.1", min_length=1,
                      description="address the HTTP proxy binds; 127.0.0.1 keeps the service on this machine")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the service")
    route_prefix: str = Field(
        "/", description="path `gti serve` mounts the service at, e.g. /gti: its endpoints are /gti/recommend..., "
                         "its page /gti/ (starts with /, no trailing /; / mounts it at the root; under `serve run "
                         "jobs/serve.yaml` that file's route_prefix applies)")
    replicas: int = Field(1, ge=1, description="replicas, each holding the loaded run (without autoscaling)")
    threads: int = Field(1, ge=1, description="torch threads (and Ray CPUs) per replica")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (0: decode on CPU)")
    min_replicas: int | None = Field(None, ge=0, description="autoscaling lower bound (None: no autoscaling)")
    max_replicas: int | None = Field(None, ge=1, description="autoscaling upper bound (None: no autoscaling)")
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="autoscaling target: requests in flight per replica")
    max_batch_size: int = Field(
        16, ge=1, description="requests a replica gathers into one constrained beam search (1: no batching)")
    batch_wait_timeout_s: float | None = Field(
        None, ge=0, description="longest a request waits for others to fill its batch (a full batch goes at once); "
                                "None: 0.25 s on CPU, where a decode takes seconds and the clients it answered "
                                "come back together (bench/RESULTS.md, \"gti serve at the decode ceiling\"), "
                                "0.01 s on a GPU")
    max_k: int = Field(100, ge=1, le=MAX_K_LIMIT, description="largest k a request may ask for")
    max_body_bytes: int = Field(65536, ge=64, description="larger request bodies are refused with 413")
    max_batch_histories: int = Field(64, ge=1, description="histories per POST /recommend/batch request")
    infer_batch_users: int = Field(
        32, ge=1, description="histories per constrained beam search in `gti infer` (a throughput job: larger than "
                              "eval.batch_users, which bounds the evaluate stage's memory per actor; --batch-users "
                              "overrides; bench/RESULTS.md, \"gti serve at the decode ceiling\")")
    unknown_items: Literal["ignore", "error"] = Field(
        "ignore", description="history ids not in the catalog: 'ignore' drops and reports them, 'error' answers 422")
    exclude_history: bool = Field(
        True, description="a request's default: leave the history's own items out of the answer")
    token_required: bool = Field(
        False, description="every endpoint needs the bearer token (the /admin/ endpoints always do)")
    token_env: str = Field(
        "GTI_SERVE_TOKEN", min_length=1,
        description="name of the environment variable holding the bearer token (<name>_FILE: a file holding it)")
    reload_poll_s: float = Field(
        2.0, ge=0, description="how often each replica looks for a newly published refresh version (0: never)")
    max_search_results: int = Field(50, ge=1, le=MAX_K_LIMIT, description="largest limit of GET /items")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where replicas decode (auto: cuda if present)")

    @field_validator("route_prefix")
    @classmethod
    def _route_prefix(cls, value: str) -> str:
        """What Ray Serve takes as a route prefix, and a path a browser keeps as written."""
        bad = sorted({c for c in value if c.isspace() or c in "?#{}"})
        if not value.startswith("/") or (value != "/" and value.endswith("/")) or "//" in value or bad:
            raise ValueError(f"serve.route_prefix must be / or a path such as /gti: starting with '/', without a "
                             f"trailing '/', '//', spaces, '?', '#' or braces; got {value!r}")
        return value

    @model_validator(mode="after")
    def _autoscaling_bounds(self) -> "ServeConfig":
        lo, hi = self.min_replicas, self.max_replicas
        if (lo is None) != (hi is None):
            raise ValueError("min_replicas and max_replicas are set together (or neither, for a fixed count)")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"min_replicas {lo} exceeds max_replicas {hi}")
        return self

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None

    def batch_wait_for(self, device_type: str) -> float:
        """`batch_wait_timeout_s` resolved for a replica decoding on `device_type` ("cpu", "cuda")."""
        if self.batch_wait_timeout_s is not None:
            return self.batch_wait_timeout_s
        return DEFAULT_BATCH_WAIT_S["cpu" if device_type == "cpu" else "gpu"]
