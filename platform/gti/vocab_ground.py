"""Grounding any new vocabulary: new tokens with descriptions -> a standard HF model folder.

What it is for: the GTI grounding stage, for tokens that are not SIDs (tool calls,
knowledge-graph nodes, product codes). `ground_vocabulary(model, tokens, out_dir)` adds the
tokens to the model's tokenizer, renders description <-> token pairs, initialises the new rows,
grounds ONLY those rows on Ray Train + DeepSpeed (backbone and old rows stay bit-identical) and
exports a standard HF folder that loads without gti; a rerun after a killed driver resumes, and
`out_dir` is swapped in whole at the end. Usage and settings (`VocabGroundConfig`):
docs/vocabulary.md.

What it does not know: stages or run folders. The pure parts are `gti.lm.described_tokens`; Ray
only through `gti.ray_start.ensure_ray` and `gti.train.ground_run.run_grounding`.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from pydantic import Field, ValidationError

from gti import config as C
from gti.config.train import GroundConfig
from gti.config.io import Seed, StrictModel, apply_overrides, format_error, read_yaml
from gti.train.ray_train import STORAGE_DIR
from gti.common.errors import ConfigError, DataError
from gti.lm.described_tokens import DEFAULT_TEMPLATES, NewToken

MODEL_META_STAGE = "vocab_ground"
INIT_FILE = "e_new_init.safetensors"
GROUND_FILE = "e_new_ground.safetensors"
PAIRS_FILE = "pairs.parquet"
VAL_FILE = "val_prompts.parquet"
SIDS_FILE = "token_ids.safetensors"
RAY_DIR = STORAGE_DIR  # gti.train.ray_train.STORAGE_DIR
RUN_NAME = "vocab_ground"
WORK_MARKER = ".gti-vocab-work"  # in the default work dir: gti made it, so gti may remove it


# --------------------------------------------------------------------------- config
class VocabModelConfig(StrictModel):
    """The model folder's loading options (the folder itself is `--model`)."""

    dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype the weights are loaded and trained in")
    trust_remote_code: bool = Field(False, description="let transformers run the model folder's own code; "
                                                       "keep off unless you wrote that code")


class VocabGroundConfig(StrictModel):
    """`gti vocab ground --config`: grounding new tokens of any vocabulary (tool calls, ...)."""

    seed: Seed = Field(0, description="seed of the new rows' initialisation, pair order and training")
    ray_address: str | None = Field(None, description="Ray cluster to join ('auto' or host:port); None = a local Ray")
    ray_num_cpus: int | None = Field(None, ge=1, description="CPUs of the local Ray it starts; None = all")
    model: VocabModelConfig = Field(default_factory=VocabModelConfig, description="how the model folder is loaded")
    init: C.InitConfig = Field(default_factory=C.InitConfig, description="initialisation of the new rows")
    ground: GroundConfig = Field(default_factory=GroundConfig,
                                   description="the grounding run (steps, lr, batch, workers)")
    templates: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_TEMPLATES),
                                      description="task name -> prompt template pairing a description with its token")
    system_prompt: str = Field("You are a helpful assistant.", description="system message of every pair's chat")
    max_len: int = Field(128, gt=8, description="tokens per pair; longer pairs are cut (and counted in a warning)")

    def run_config(self, model_path: str | Path) -> C.RunConfig:
        """The RunConfig the grounding workers read (model.name = the resolved folder)."""
        return C.RunConfig(
            seed=self.seed, ray_address=self.ray_address, ray_num_cpus=self.ray_num_cpus,
            model=C.ModelConfig(name=str(model_path), dtype=self.model.dtype,
                                trust_remote_code=self.model.trust_remote_code),
            init=self.init, ground=self.ground,
        )


def load_config(path: str | Path | None = None, overrides: Sequence[str] | None = None) -> VocabGroundConfig:
    """YAML (or defaults) + key=value overrides -> VocabGroundConfig; ConfigError names the key."""
    raw = read_yaml(path) if path is not None else {}
    source = str(path) if path is not None else "<defaults>"
    if overrides:
        raw = apply_overrides(raw, list(overrides), source)
        source += " (with overrides)"
    try:
        return VocabGroundConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_error(err, source)) from None


# --------------------------------------------------------------------------- result
@dataclass
class VocabGroundResult:
    """What `ground_vocabulary` produced."""

    out_dir: Path
    token_ids: dict[str, int]  # new token -> id in the exported tokenizer
    new_token_ids: tuple[int, int]  # [first, end)
    init_method: str
    steps_done: int
    first_loss: float | None = None
    final_loss: float | None = None
    val_exact_match: list[dict[str, float]] = field(default_factory=list)  # [{step, value}]
    val_split: str = "train"  # "val" (eval_descriptions) or "train" (in-sample)
    n_train_pairs: int = 0
    wall_s: float = 0.0


# --------------------------------------------------------------------------- API
def ground_vocabulary(
    model: str | Path,
    tokens: Sequence[NewToken | dict] | str | Path,
    out_dir: str | Path,
    *,
    config: VocabGroundConfig | str | Path | None = None,
    templates: dict[str, str] | None = None,
    work_dir: str | Path | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> VocabGroundResult:
    """Add `tokens` to the model at `model`, ground their rows, export to `out_dir`.

    model: a local HF folder (safetensors weights, a tokenizer with a chat template), or
        `smollm2-135m`.
    tokens: NewTokens, dicts {"token", "descriptions", "eval_descriptions"?}, or a tokens file
        (`gti.lm.described_tokens.read_tokens`: JSONL or a YAML/JSON list).
    config: VocabGroundConfig, or a YAML path; None = defaults (init mean, 200 steps, lr 1e-3).
    templates: overrides `config.templates` ({desc2token: "...{description}...",
        token2desc: "...{token}..."}).
    force: replace `out_dir` even when it is a non-empty folder that is not a gti export (never
        when it is or contains the model, the tokens file, the work dir, the current or home
        directory). `out_dir` is checked before any work and swapped in whole at the end
        (`gti.common.files`); a rerun after a killed driver resumes from the last checkpoint in
        the work dir. The init method may be any `init.method` but `codebook`.
    Returns a VocabGroundResult. User mistakes raise GtiError subclasses (one line).
    """
    t_start = time.time()
    out_dir = Path(out_dir).expanduser().resolve()
    own_work = work_dir is None
    work = Path(work_dir).expanduser().resolve() if work_dir is not None \
        else out_dir.with_name(f".{out_dir.name}.work")
    protected = _protected(model, tokens, None if own_work else work)
    _check_out(out_dir, force, protected)  # before any work: a refused folder costs nothing
    from gti.run.runlock import RunLock

    # One writer per output: a second `gti vocab ground --out` of the same folder is refused.
    with RunLock(out_dir.parent, name=f".{out_dir.name}.gti.lock"):
        return _ground_locked(model, tokens, out_dir, config, templates, work, own_work, force, protected, log,
                              t_start)


def _ground_locked(model, tokens, out_dir: Path, config, templates, work: Path, own_work: bool, force: bool,
                   protected: dict, log: Callable[[str], None], t_start: float) -> VocabGroundResult:
    cfg, toks = _settings(config, templates, tokens)
    _open_work(work, own_work)

    ext = _load_and_extend(model, cfg, toks, log)
    if isinstance(ext.model_path, Path):  # e.g. smollm2-135m, resolved into the cache
        protected["--model"] = ext.model_path
    pairs, n_train = _write_pairs(ext, toks, cfg, work, log)
    init = _initial_rows(ext, toks, cfg, work)
    g = cfg.ground
    grounded = g.enabled and g.steps > 0
    final, res_facts = init, {"steps_done": 0}
    val_split = "val" if any(t.eval_descriptions for t in toks) else "train"
    if grounded:
        final, res_facts = _fit(cfg, ext.run_cfg, work, pairs, ext.ids, ext.tok, ext.first, ext.end, val_split, log)
    else:
        log("ground.enabled is false or ground.steps is 0: exporting the initialised rows")

    _export(ext, cfg, init, final, grounded, res_facts["steps_done"], out_dir, force, protected)
    shutil.rmtree(work / RAY_DIR, ignore_errors=True)
    if own_work and (work / WORK_MARKER).is_file():
        shutil.rmtree(work, ignore_errors=True)
    log(f"exported {out_dir}")
    return VocabGroundResult(
        out_dir=out_dir, token_ids=ext.ids, new_token_ids=(ext.first, ext.end), init_method=cfg.init.method,
        steps_done=int(res_facts["steps_done"]), first_loss=res_facts.get("first_loss"),
        final_loss=res_facts.get("final_loss"), val_exact_match=res_facts.get("val_exact_match", []),
        val_split=val_split, n_train_pairs=n_train, wall_s=round(time.time() - t_start, 2),
    )


def _protected(model: str | Path, tokens: Any, work: Path | None) -> dict[str, Path | None]:
    """The paths `out_dir` may neither be nor contain: the model folder, the tokens file and a
    caller's work dir (the current and home directories are always protected)."""
    from gti.lm import models

    out: dict[str, Path | None] = {}
    if isinstance(model, (str, Path)) and Path(model).expanduser().exists():
        out["--model"] = Path(model).expanduser()
    elif str(model) == models.SMOLLM2_NAME:
        out["--model"] = models.cache_root() / "models" / models.SMOLLM2_NAME
    if isinstance(tokens, (str, Path)) and Path(tokens).expanduser().exists():
        out["--tokens"] = Path(tokens).expanduser()
    out["the work folder"] = work
    return out


def _check_out(out_dir: Path, force: bool, protected: dict[str, Path | None]) -> None:
    from gti.common.files import check_replaceable_dir
    from gti.lm.new_rows import is_export

    check_replaceable_dir(out_dir, is_ours=is_export, force=force, protected=protected, what="--out",
                          ours="a gti export (no gti_meta.json)")


def _open_work(work: Path, own: bool) -> None:
    """Create the work dir; the default one is marked as gti's (so that only it is ever removed),
    and a folder of its name without the marker is refused."""
    if own:
        if work.exists() and not (work / WORK_MARKER).is_file() and (not work.is_dir() or any(work.iterdir())):
            raise DataError(f"work folder {work} exists and was not made by gti vocab ground; "
                            "remove or rename it, then rerun")
        work.mkdir(parents=True, exist_ok=True)
        (work / WORK_MARKER).touch()
    else:
        work.mkdir(parents=True, exist_ok=True)


def _settings(config: VocabGroundConfig | str | Path | None, templates: dict[str, str] | None,
              tokens: Sequence[NewToken | dict] | str | Path) -> tuple[VocabGroundConfig, list[NewToken]]:
    """The resolved config and the parsed tokens; every settings mistake raises before any work."""
    from gti.lm import described_tokens

    cfg = config if isinstance(config, VocabGroundConfig) else load_config(config)
    if templates is not None:
        cfg = cfg.model_copy(update={"templates": dict(templates)})
    toks = (described_tokens.read_tokens(tokens) if isinstance(tokens, (str, Path))
            else described_tokens.parse_tokens(list(tokens)))
    if cfg.init.method == "codebook":
        raise ConfigError("init.method=codebook needs SID codebooks; new vocabulary has none "
                          "(use mean, mean_noise, random or description)")
    described_tokens.pair_templates(cfg.templates)  # ConfigError on a bad template before any work
    return cfg, toks


@dataclass
class _Extended:
    """The base model and its tokenizer with the new tokens added (ids [first, end))."""

    model_path: Path
    run_cfg: C.RunConfig
    base: Any  # the loaded model, rows not yet attached
    tok: Any
    n_real: int  # tokenizer size before the new tokens
    first: int
    end: int
    ids: dict[str, int]  # new token -> id


def _load_and_extend(model: str | Path, cfg: VocabGroundConfig, toks: list[NewToken], log) -> _Extended:
    """Resolve and load the model, refuse tokens it already has, add the new ones."""
    from gti.lm import models, new_rows

    model_path = models.resolve_model_path(C.ModelConfig(name=str(model), trust_remote_code=cfg.model.trust_remote_code),
                                           log=log)
    run_cfg = cfg.run_config(model_path)
    base, tok = models.load_model_and_tokenizer(run_cfg.model)
    n_real = len(tok)
    have = tok.get_vocab()
    clash = [t.token for t in toks if t.token in have]
    if clash:
        raise DataError(f"tokens: '{clash[0]}' is already in the tokenizer of {model_path}"
                        + (f" (and {len(clash) - 1} more)" if len(clash) > 1 else ""))
    first, end = new_rows.extend_tokenizer(tok, [t.token for t in toks])
    ids = {t.token: first + i for i, t in enumerate(toks)}
    log(f"{end - first} new tokens [{first}, {end}) for {model_path}; init '{cfg.init.method}'")
    return _Extended(model_path, run_cfg, base, tok, n_real, first, end, ids)


def _write_pairs(ext: _Extended, toks: list[NewToken], cfg: VocabGroundConfig, work: Path, log) -> tuple[dict, int]:
    """The grounding pairs, one row per (token, description, direction), to work/pairs.parquet;
    -> (pairs, training rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gti.lm import described_tokens
    from gti.data.schemas import PAIRS_SCHEMA

    pairs = described_tokens.render_pairs(ext.tok, toks, [ext.ids[t.token] for t in toks], cfg.templates,
                                          cfg.system_prompt, cfg.max_len)
    pq.write_table(pa.table({c: pairs[c] for c in PAIRS_SCHEMA.names}, schema=PAIRS_SCHEMA), work / PAIRS_FILE)
    n_train = sum(s == "train" for s in pairs["split"])
    truncated = sum(map(bool, pairs["truncated"]))
    if truncated:
        log(f"WARNING: {truncated} pairs were cut to max_len={cfg.max_len} tokens")
    return pairs, n_train


def _initial_rows(ext: _Extended, toks: list[NewToken], cfg: VocabGroundConfig, work: Path) -> dict[str, Any]:
    """The new rows as `init.method` makes them, saved to work/e_new_init.safetensors."""
    from safetensors.torch import save_file

    from gti.lm import described_tokens

    # Descriptions for init.method=description, tokenised without the template.
    desc_ids = [ext.tok([*t.descriptions], add_special_tokens=False)["input_ids"] for t in toks]
    init = described_tokens.initial_rows(cfg.init.method, ext.base, ext.n_real, ext.end - ext.first,
                                         description_ids=desc_ids, noise_std=cfg.init.noise_std, seed=cfg.seed)
    save_file({k: v.contiguous() for k, v in init.items()}, str(work / INIT_FILE))
    return init


def _export(ext: _Extended, cfg: VocabGroundConfig, init: dict[str, Any], final: dict[str, Any], grounded: bool,
            steps_done: int, out_dir: Path, force: bool = False,
            protected: dict[str, Path | None] | None = None) -> None:
    """The base model with the final rows as a standard HF folder, plus the rows before/after
    (written into the folder before it is swapped in: it appears complete or not at all)."""
    from safetensors.torch import save_file

    from gti.lm import new_rows

    new_rows.attach_new_rows(ext.base, ext.first, ext.end - ext.first, init["e_new"], init.get("head_new"))
    new_rows.load_new_rows_state_dict(ext.base, final)
    meta = {
        "stage": MODEL_META_STAGE,
        "base_model": str(ext.model_path),
        "new_token_ids": [ext.first, ext.end],
        "tokens": ext.ids,
        "init_method": cfg.init.method,
        "grounded": grounded,
        "steps_done": steps_done,
        "templates": cfg.templates,
        "system_prompt": cfg.system_prompt,
    }

    def rows(tmp: Path) -> None:
        save_file({k: v.contiguous() for k, v in init.items()}, str(tmp / INIT_FILE))
        save_file({k: v.contiguous() for k, v in final.items()}, str(tmp / GROUND_FILE))

    new_rows.export_model(ext.base, ext.tok, out_dir, meta, force=force, protected=protected, extra=rows)


def _fit(cfg: VocabGroundConfig, run_cfg: C.RunConfig, work: Path, pairs: dict, ids: dict[str, int], tok,
         first: int, end: int, val_split: str, log) -> tuple[dict, dict[str, Any]]:
    """The grounding run (`gti.train.ground_run.run_grounding`, the `ground` stage's runner),
    validated by constrained greedy description -> token over the new tokens (a one-level
    trie); -> (trained rows, {steps_done, first_loss, final_loss, val_exact_match})."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import save_file

    from gti.lm import described_tokens
    from gti.ray_start import ensure_ray
    from gti.train.ground_run import GroundingInputs, run_grounding
    from gti.train.worker_config import GroundRows, ValSet

    g = cfg.ground
    prompts, targets = described_tokens.description_prompts(pairs, ids, val_split)
    rng = np.random.default_rng(cfg.seed)
    keep = np.sort(rng.choice(len(prompts), size=min(g.val_samples, len(prompts)), replace=False))
    pq.write_table(pa.table({"prompt": [prompts[i] for i in keep], "target": [[targets[i]] for i in keep]}),
                   work / VAL_FILE)
    order = sorted(ids.values())
    save_file({"sid_token_ids": torch.tensor(order, dtype=torch.long).reshape(-1, 1)}, str(work / SIDS_FILE))
    inputs = GroundingInputs(
        run_cfg=run_cfg, pairs_path=work / PAIRS_FILE, rows=GroundRows(str(work / INIT_FILE), first, end - first),
        pad_id=int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id),
        val=ValSet(str(work / VAL_FILE), str(work / SIDS_FILE), first, end, levels=1) if len(keep) else None,
        where="tokens", noun="training pairs",
        note=f"weight decay {g.weight_decay:g}; {'held-out' if val_split == 'val' else 'in-sample'} validation",
    )
    res = run_grounding(inputs, storage_path=work / RAY_DIR, name=RUN_NAME, start_ray=lambda: ensure_ray(run_cfg),
                        log=log)
    return res.state_dict, {k: res.facts[k] for k in ("steps_done", "first_loss", "final_loss", "val_exact_match")}


# --------------------------------------------------------------------------- CLI
def cli_main(args) -> int:
    """`gti vocab ground --model DIR --tokens FILE --out DIR [--config YAML] [key=value ...]`."""
    cfg = load_config(args.config, getattr(args, "overrides", None))
    res = ground_vocabulary(args.model, args.tokens, args.out, config=cfg, force=bool(getattr(args, "force", False)))
    last = f"{res.val_exact_match[-1]['value']:.3f}" if res.val_exact_match else "n/a"

    def fmt(x):
        return "n/a" if x is None else f"{x:.4f}"

    print(f"grounded {len(res.token_ids)} tokens [{res.new_token_ids[0]}, {res.new_token_ids[1]}) "
          f"in {res.steps_done} steps ({res.wall_s:.0f}s); loss {fmt(res.first_loss)} -> {fmt(res.final_loss)}; "
          f"exact match ({'held-out' if res.val_split == 'val' else 'in-sample'}) {last}; model: {res.out_dir}")
    return 0
