"""Vocabulary surgery: adding SID tokens to an HF causal LM with the new rows in their own
parameter, and merging them back for export.

What it is for: `extend_tokenizer` adds the SID tokens (and markers) so each encodes as ONE token;
`attach_new_rows` installs `SplitEmbedding` / `SplitLMHead`, a frozen old table plus a trainable
`new_rows` parameter; `merge_new_rows` / `export_model` fold them back into a standard HF folder,
loadable with `AutoModelForCausalLM.from_pretrained` and no gti code. Under ZeRO-3 every read of
a possibly partitioned parameter goes through `gathered(...)`: call `attach_new_rows` before
`deepspeed.initialize`, merge/export on rank 0 from the engine's module (gathered).

What it does NOT know: how the initial rows are computed (`gti.lm.init`), training, or Ray.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gti.common.errors import ConfigError

SID_START = "<sid_start>"
SID_END = "<sid_end>"
META_NAME = "gti_meta.json"


class VocabError(ConfigError):
    """The tokenizer or model cannot be extended as asked; one line naming the problem."""


# --------------------------------------------------------------------------- tokenizer
def extend_tokenizer(tokenizer, new_tokens: list[str], markers: bool = False) -> tuple[int, int]:
    """Add `new_tokens` (+ markers appended at the end) to `tokenizer`; return `[first, end)`.

    The ids are contiguous and SID tokens come first, in the given (level-major) order, so
    `first + i` is the id of `new_tokens[i]`; with markers, `end - 2` is `<sid_start>` and
    `end - 1` is `<sid_end>`. Calling it again with the same tokens on an already-extended
    tokenizer is a no-op that returns the same range. The range is read back from the tokenizer
    (never from the embedding-matrix size), so a model whose matrix is padded past its tokenizer
    (Qwen3) gets its new rows at the tokenizer ids; the stage manifests record `[first, end)` as
    the new rows.
    """
    from tokenizers import AddedToken

    toks = list(new_tokens) + ([SID_START, SID_END] if markers else [])
    if not toks:
        raise VocabError("no new tokens to add (sid.new_tokens is empty)")
    if len(set(toks)) != len(toks):
        raise VocabError("new tokens contain duplicates")
    vocab = tokenizer.get_vocab()
    present = [t for t in toks if t in vocab]
    if present and len(present) != len(toks):
        raise VocabError(f"token '{present[0]}' already exists in the tokenizer")
    if not present:
        # normalized=False keeps "<a_12>" verbatim; special=False so decode() still shows them.
        added = tokenizer.add_tokens(
            [AddedToken(t, normalized=False, special=False, single_word=False) for t in toks]
        )
        if added != len(toks):
            raise VocabError(f"tokenizer added {added} of {len(toks)} new tokens")
    ids = tokenizer.convert_tokens_to_ids(toks)
    first = ids[0]
    if ids != list(range(first, first + len(toks))):
        raise VocabError("new token ids are not contiguous in the tokenizer")
    return first, first + len(toks)


# --------------------------------------------------------------------------- ZeRO-3
@contextlib.contextmanager
def gathered(params: Iterable[Tensor], modifier_rank: int | None = None):
    """Gather ZeRO-3-partitioned parameters for the duration of the block: wraps
    `deepspeed.zero.GatheredParameters` when a parameter carries DeepSpeed's `ds_id` (no-op
    otherwise).

    `modifier_rank=None` is read-only; pass 0 when rank 0 writes into them."""
    parts = [p for p in params if hasattr(p, "ds_id")]
    if not parts:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(parts, modifier_rank=modifier_rank):
        yield


# --------------------------------------------------------------------------- modules
class _NewRowsSpan:
    """The id span [first_new_id, end_id) covered by a module's `new_rows` [V_new, d]."""

    new_rows: torch.Tensor
    first_new_id: int

    @property
    def n_new(self) -> int:
        return int(self.new_rows.shape[0])

    @property
    def end_id(self) -> int:
        return self.first_new_id + self.n_new


class SplitEmbedding(_NewRowsSpan, nn.Module):
    """Input embedding = frozen `old_weight` [V_old, d] + trainable `new_rows` [V_new, d].

    forward(ids LongTensor[...]) -> Tensor[..., d]; ids in [first_new_id, first_new_id+V_new)
    read `new_rows[id - first_new_id]`, the rest read `old_weight[id]`.
    """

    def __init__(self, old_weight: nn.Parameter, new_rows: nn.Parameter, first_new_id: int,
                 padding_idx: int | None = None):
        super().__init__()
        old_weight.requires_grad_(False)
        self.old_weight = old_weight
        self.new_rows = new_rows
        self.first_new_id = int(first_new_id)
        self.padding_idx = padding_idx

    @property
    def num_embeddings(self) -> int:
        return max(int(self.old_weight.shape[0]), self.end_id)

    @property
    def embedding_dim(self) -> int:
        return int(self.old_weight.shape[1])

    def forward(self, ids: Tensor) -> Tensor:
        is_new = (ids >= self.first_new_id) & (ids < self.end_id)
        v_old = self.old_weight.shape[0]
        old = F.embedding(ids.clamp(0, v_old - 1), self.old_weight)
        new = F.embedding((ids - self.first_new_id).clamp(0, self.n_new - 1), self.new_rows)
        # torch.where gives exactly zero gradient to the unselected branch, so new_rows only
        # receives gradient from positions that hold new ids.
        return torch.where(is_new.unsqueeze(-1), new.to(old.dtype), old)

    def extra_repr(self) -> str:
        return (f"old={tuple(self.old_weight.shape)} (frozen), new={tuple(self.new_rows.shape)} "
                f"at ids [{self.first_new_id}, {self.end_id})")


class SplitLMHead(_NewRowsSpan, nn.Module):
    """Output head: logits[..., V] with V = max(V_old_rows, end_id); columns
    [first_new_id, end_id) come from `new_rows` [V_new, d], all others from the frozen
    `old_weight` [V_old_rows, d] (and frozen `old_bias` if the head had one; new ids get bias 0).
    Correct both when the new ids extend the matrix and when they land on padding rows.

    forward(h Tensor[..., d]) -> Tensor[..., V].
    """

    def __init__(self, old_weight: nn.Parameter, new_rows: nn.Parameter, first_new_id: int,
                 old_bias: nn.Parameter | None = None):
        super().__init__()
        old_weight.requires_grad_(False)
        self.old_weight = old_weight
        self.new_rows = new_rows
        self.first_new_id = int(first_new_id)
        if old_bias is not None:
            old_bias.requires_grad_(False)
        self.old_bias = old_bias

    @property
    def out_features(self) -> int:
        return max(int(self.old_weight.shape[0]), self.end_id)

    def forward(self, h: Tensor) -> Tensor:
        old = F.linear(h, self.old_weight, self.old_bias)
        new = F.linear(h, self.new_rows.to(h.dtype))
        parts = [old[..., : self.first_new_id], new.to(old.dtype)]
        if self.end_id < old.shape[-1]:  # new ids sit on padding rows of the old matrix
            parts.append(old[..., self.end_id:])
        return torch.cat(parts, dim=-1)

    def extra_repr(self) -> str:
        return (f"old={tuple(self.old_weight.shape)} (frozen), new={tuple(self.new_rows.shape)} "
                f"at ids [{self.first_new_id}, {self.end_id})")


def split_modules(model) -> tuple[SplitEmbedding, SplitLMHead | None]:
    emb = model.get_input_embeddings()
    if not isinstance(emb, SplitEmbedding):
        raise VocabError("model has no new rows attached (call attach_new_rows first)")
    head = model.get_output_embeddings()
    return emb, head if isinstance(head, SplitLMHead) else None


def is_split(model) -> bool:
    return isinstance(model.get_input_embeddings(), SplitEmbedding)


def heads_tied(model) -> bool:
    """True when the output head shares its weight with the input embedding."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None:
        return False
    if isinstance(emb, SplitEmbedding) and isinstance(head, SplitLMHead):
        return head.new_rows is emb.new_rows
    return head.weight is emb.weight


def old_rows(model, n_rows: int | None = None, which: str = "input") -> Tensor:
    """A float32 CPU copy of the first `n_rows` rows of the old input (or output) matrix,
    gathered under ZeRO-3. Pass `n_rows=len(tokenizer)` before extension so padding rows
    never enter vocabulary statistics."""
    mod = model.get_input_embeddings() if which == "input" else model.get_output_embeddings()
    if mod is None:
        raise VocabError(f"model has no {which} embedding matrix")
    w = mod.old_weight if isinstance(mod, (SplitEmbedding, SplitLMHead)) else mod.weight
    with gathered([w]):
        n = w.shape[0] if n_rows is None else n_rows
        return w[:n].detach().to("cpu", torch.float32).clone()


# --------------------------------------------------------------------------- attach / merge
def attach_new_rows(model, first_new_id: int, n_new: int, init_in: Tensor,
                    init_out: Tensor | None = None):
    """Replace the input embedding (and output head) of `model` by split modules, in place.

    init_in: Tensor[n_new, d], the initial new input rows (also the head's rows when tied).
    init_out: Tensor[n_new, d] for an untied head; None copies `init_in`.
    The old matrices become frozen `old_weight`s (requires_grad False, never given to an
    optimizer); the new rows are the only trainable tensors the split modules own. Because the
    old rows are a different tensor from anything the optimizer holds, they stay bit-identical
    through any number of AdamW steps with weight decay (zeroing gradients of rows inside one big
    matrix does NOT achieve that: decoupled weight decay still moves them). Tied heads share ONE
    `new_rows` parameter between input and output; untied heads get their own.
    `model.config.vocab_size` becomes max(V_old_rows, first+n_new). Returns the model.
    """
    if is_split(model):
        raise VocabError("model already has new rows attached")
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and (head.weight is emb.weight or getattr(model.config, "tie_word_embeddings", False))
    if tuple(init_in.shape) != (n_new, emb.weight.shape[1]) and not hasattr(emb.weight, "ds_id"):
        raise VocabError(f"init rows have shape {tuple(init_in.shape)}, expected ({n_new}, {emb.weight.shape[1]})")
    with gathered([emb.weight]):
        dtype, device = emb.weight.dtype, emb.weight.device
        v_old = int(emb.weight.shape[0])
    if first_new_id > v_old:
        raise VocabError(f"first new id {first_new_id} leaves a gap after the {v_old} matrix rows")
    new_in = nn.Parameter(init_in.detach().to(device=device, dtype=dtype).clone())
    model.set_input_embeddings(
        SplitEmbedding(emb.weight, new_in, first_new_id, getattr(emb, "padding_idx", None))
    )
    if head is not None:
        if tied:
            new_out = new_in
        else:
            src = init_in if init_out is None else init_out
            new_out = nn.Parameter(src.detach().to(device=device, dtype=head.weight.dtype).clone())
        model.set_output_embeddings(
            SplitLMHead(head.weight, new_out, first_new_id, getattr(head, "bias", None))
        )
    model.config.vocab_size = max(v_old, first_new_id + n_new)
    return model


def _merged_matrix(old: Tensor, new: Tensor, first: int) -> Tensor:
    """old [V_old, d] with rows [first, first+V_new) replaced by new (grown if needed)."""
    end = first + new.shape[0]
    v = max(old.shape[0], end)
    out = torch.zeros(v, old.shape[1], dtype=old.dtype, device=old.device)
    out[: old.shape[0]] = old.detach()
    out[first:end] = new.detach().to(old.dtype)
    return out


def merge_new_rows(model):
    """Fold split modules back into standard `nn.Embedding` / `nn.Linear` modules, in place.

    The merged matrix keeps every old row (padding included) and holds the new rows at their
    tokenizer ids; tied models get one shared weight again. The merged weights are fresh
    parameters with requires_grad True; other parameters keep their flags. Returns the model.
    """
    emb, head = split_modules(model)
    tied = heads_tied(model)
    params = [emb.old_weight, emb.new_rows] + ([head.old_weight, head.new_rows] if head else [])
    with gathered(params):
        w_in = _merged_matrix(emb.old_weight, emb.new_rows, emb.first_new_id)
        new_emb = nn.Embedding(w_in.shape[0], w_in.shape[1], padding_idx=emb.padding_idx,
                               device=w_in.device, dtype=w_in.dtype)
        new_emb.weight = nn.Parameter(w_in)
        model.set_input_embeddings(new_emb)
        if head is not None:
            bias = None
            if head.old_bias is not None:
                bias = torch.zeros(w_in.shape[0], dtype=head.old_bias.dtype, device=head.old_bias.device)
                bias[: head.old_bias.shape[0]] = head.old_bias.detach()
                bias[head.first_new_id: head.end_id] = 0
            lin = nn.Linear(w_in.shape[1], w_in.shape[0], bias=bias is not None,
                            device=w_in.device, dtype=w_in.dtype)
            if tied:
                lin.weight = new_emb.weight
            else:
                lin.weight = nn.Parameter(_merged_matrix(head.old_weight, head.new_rows, head.first_new_id))
            if bias is not None:
                lin.bias = nn.Parameter(bias)
            model.set_output_embeddings(lin)
    model.config.vocab_size = int(w_in.shape[0])
    return model


# --------------------------------------------------------------------------- training helpers
def new_rows_parameters(model) -> list[nn.Parameter]:
    """The trainable new-row parameters: [input rows] when tied, [input rows, head rows] when
    untied. These (and only these) go into the grounding optimizer."""
    emb, head = split_modules(model)
    out = [emb.new_rows]
    if head is not None and head.new_rows is not emb.new_rows:
        out.append(head.new_rows)
    return out


def freeze_backbone(model):
    """requires_grad False on every parameter except the new rows. Returns the model."""
    keep = {id(p) for p in new_rows_parameters(model)}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    return model


def new_rows_state_dict(model) -> dict[str, Tensor]:
    """{"e_new": [V_new, d]} plus {"head_new": [V_new, d]} for untied heads; CPU float32
    copies, gathered under ZeRO-3 (for e_new_*.safetensors and checkpoints)."""
    params = new_rows_parameters(model)
    with gathered(params):
        out = {"e_new": params[0].detach().to("cpu", torch.float32).clone()}
        if len(params) > 1:
            out["head_new"] = params[1].detach().to("cpu", torch.float32).clone()
    return out


def load_new_rows_state_dict(model, state: dict[str, Tensor]) -> None:
    """Copy `new_rows_state_dict` output back into the model's new rows (in place)."""
    params = new_rows_parameters(model)
    names = ["e_new", "head_new"][: len(params)]
    missing = [n for n in names if n not in state]
    if missing:
        raise VocabError(f"new-row state lacks {missing}")
    with gathered(params, modifier_rank=0), torch.no_grad():
        for n, p in zip(names, params):
            if tuple(state[n].shape) != tuple(p.shape) and not hasattr(p, "ds_id"):
                raise VocabError(f"new-row state '{n}' has shape {tuple(state[n].shape)}, expected {tuple(p.shape)}")
            p.copy_(state[n].to(p.dtype))


# --------------------------------------------------------------------------- export
def is_export(p: str | Path) -> bool:
    """Whether folder `p` is a model folder gti exported (it holds `gti_meta.json`)."""
    return (Path(p) / META_NAME).is_file()


def export_model(model, tokenizer, out_dir: str | Path, meta: dict[str, Any], *, force: bool = False,
                 protected: dict[str, Any] | None = None,
                 extra: Callable[[Path], None] | None = None) -> Path:
    """Write a standard HF folder (safetensors weights, config, generation config, tokenizer)
    plus `gti_meta.json` (`meta`, e.g. sid_map_hash and new_token_ids) to `out_dir`.

    A split model is merged on a deep copy, so `model` itself keeps training as it was. The
    folder is written in a temp dir beside `out_dir` (`extra(tmp)` may add files to it) and
    swapped into place (`gti.common.files.replace_dir`), so a crash never leaves a folder that looks
    complete and `out_dir` is never missing. An existing `out_dir` is replaced only when it is
    empty or a gti export (`is_export`), or with `force`; never when it is or contains the
    current or home directory or one of `protected` ({label: path}): `UnsafeReplaceError`,
    raised before anything is written. Under ZeRO-3 call it on rank 0 with the module's
    parameters gathered.
    """
    from gti.common.files import check_replaceable_dir, replace_dir

    out_dir = Path(out_dir)
    check_replaceable_dir(out_dir, is_ours=is_export, force=force, protected=protected, ours="a gti export")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    to_save = merge_new_rows(copy.deepcopy(model)) if is_split(model) else model
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        to_save.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / META_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
        if extra is not None:
            extra(tmp)
        # Checked again: the folder may have changed during the save.
        check_replaceable_dir(out_dir, is_ours=is_export, force=force, protected=protected, ours="a gti export")
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_meta(model_dir: str | Path) -> dict[str, Any]:
    """The `gti_meta.json` of an exported model folder ({} when absent)."""
    p = Path(model_dir) / META_NAME
    return json.loads(p.read_text()) if p.is_file() else {}
