"""The `serve:` section of the run config: how `gti serve` runs the recommender online.

What it is for: `ServeConfig`, every setting of the service (where it listens and the path it is
mounted at, replicas and threads per replica, autoscaling bounds, request batching, the memory
one decode may hold, request limits, unknown item ids, whether every endpoint needs the bearer
token); `decode_budget(kv_bytes_per_token, memory_bytes, share)` is the default of
`serve.decode_budget_tokens` (pure: the replica supplies the model's figure and its memory).
`gti.config.RunConfig` holds it as `serve`; it enters no stage's fingerprint.

What it does NOT know: the token itself (only the NAME of the environment variable holding it:
a secret never lives in a config file), the run being served, FastAPI or Ray. It never imports
ray or torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from gti.config.io import StrictModel

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
        16, ge=1, description="histories a replica gathers from concurrent requests into one batch (counted in "
                              "histories, not requests; a request is never split: one with more histories is "
                              "batched alone; 1: no batching). A batch runs as one or more decodes of at most "
                              "decode_budget_tokens")
    decode_budget_tokens: int | None = Field(
        None, ge=1, description="the most key/value-cache tokens one decode (one constrained beam search) may hold: "
                                "histories x beam width x (prompt + SID tokens), each history repeated once per "
                                "beam. A larger batch runs as several decodes; a single history over it is refused "
                                "with 413. None: decode_memory_share of the replica's memory over the model's "
                                "cache bytes per token (`decode_budget`)")
    decode_memory_share: float = Field(
        0.25, gt=0, le=0.9, description="share of a replica's memory one decode's key/value cache may take when "
                                        "decode_budget_tokens is unset: of the GPU's (times num_gpus below 1), or on "
                                        "CPU of the machine's RAM divided by the replicas (max_replicas with "
                                        "autoscaling: they may all share one machine). The rest holds the weights, "
                                        "the step's logits and the other requests")
    batch_wait_timeout_s: float | None = Field(
        None, ge=0, description="longest a request waits for others to fill its batch (a full batch goes at once); "
                                "None: 0.25 s on CPU, where a decode takes seconds and the clients it answered "
                                "come back together (bench/serve/RESULTS.md, \"gti serve at the decode ceiling\"), "
                                "0.01 s on a GPU")
    max_k: int = Field(100, ge=1, le=MAX_K_LIMIT, description="largest k a request may ask for")
    max_body_bytes: int = Field(65536, ge=64, description="larger request bodies are refused with 413")
    max_batch_histories: int = Field(64, ge=1, description="histories per POST /recommend/batch request")
    infer_batch_users: int = Field(
        32, ge=1, description="histories per constrained beam search in `gti infer` (a throughput job: larger than "
                              "eval.batch_users, which bounds the evaluate stage's memory per actor; --batch-users "
                              "overrides; bench/serve/RESULTS.md, \"gti serve at the decode ceiling\")")
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
        2.0, ge=0, description="how often each replica looks for a newly published refresh version and for the "
                               "version POST /admin/reload pinned for all replicas: every replica serves the same "
                               "version within this plus one model load (0: never; replicas then follow neither)")
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

    def decode_budget_for(self, kv_bytes_per_token: int, device_memory_bytes: int, device_type: str) -> int:
        """`decode_budget_tokens`, or its default for a replica decoding on `device_type` whose
        device (GPU, or on CPU the machine) has `device_memory_bytes` (see the fields)."""
        if self.decode_budget_tokens is not None:
            return self.decode_budget_tokens
        if device_type == "cpu":
            memory = device_memory_bytes / max(1, self.max_replicas or self.replicas)
        else:
            memory = device_memory_bytes * min(1.0, self.num_gpus or 1.0)
        return decode_budget(kv_bytes_per_token, int(memory), self.decode_memory_share)

    def batch_wait_for(self, device_type: str) -> float:
        """`batch_wait_timeout_s` resolved for a replica decoding on `device_type` ("cpu", "cuda")."""
        if self.batch_wait_timeout_s is not None:
            return self.batch_wait_timeout_s
        return DEFAULT_BATCH_WAIT_S["cpu" if device_type == "cpu" else "gpu"]


def decode_budget(kv_bytes_per_token: int, memory_bytes: int, share: float) -> int:
    """Key/value-cache tokens that fit in `share` of `memory_bytes`, each token taking
    `kv_bytes_per_token` (keys and values of every layer: 2 x layers x kv heads x head dim x
    dtype bytes; SmolLM2-135M in float32: 2 x 30 x 3 x 64 x 4 = 46,080). At least 1 token."""
    if kv_bytes_per_token < 1:
        raise ValueError(f"kv_bytes_per_token must be >= 1, got {kv_bytes_per_token}")
    return max(1, int(memory_bytes * share) // int(kv_bytes_per_token))
