"""The GRPO objective: group-normalised advantages, per-token log-probs at the SID positions, and
the clipped policy-gradient loss with a KL penalty to a frozen reference (pure torch).

What it is for: one RL update over a batch of B prompts x G completions: `group_advantages`,
`labelled_logprobs` (only a completion's SID tokens count), `grpo_loss` (PPO's clipped objective
with a k3 KL to the reference) and `reward_stats`. Every log-prob is the full-vocabulary
log-softmax at temperature 1, the quantity the beam search scores and SFT's cross-entropy use;
the trie mask and the sampling temperature belong to the rollout (behaviour) policy only.

What it does not know: how completions were produced (`gti.rl.rollouts`), what the rewards mean
(`gti.rl.rewards`), optimizers, DeepSpeed (an engine is run through its own forward), or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn import functional as F

from gti.train.loss import IGNORE_INDEX, is_engine, labelled_logits, supports_labelled_loss


# --------------------------------------------------------------------------- advantages
def group_advantages(rewards: Tensor, eps: float = 1e-6, zero_tol: float = 1e-8) -> tuple[Tensor, Tensor]:
    """Group-normalised advantages.

    rewards: FloatTensor [B, G] (B prompts, G candidates each).
    Returns (advantages [B, G] float32, zero_std [B] bool). advantages[b] = (r[b] - mean(r[b]))
    / (std(r[b]) + eps) with the population std (divisor G, so G = 1 is allowed and gives 0);
    a group whose std is <= zero_tol (every candidate rewarded alike: no learning signal) gets
    exactly zero advantages and is marked in `zero_std`.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G], got shape {tuple(rewards.shape)}")
    r = rewards.float()
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    zero = std.squeeze(1) <= zero_tol
    adv = (r - mean) / (std + eps)
    return torch.where(zero.unsqueeze(1), torch.zeros_like(adv), adv), zero


def reward_stats(rewards: Tensor, zero_tol: float = 1e-8) -> dict[str, float]:
    """Summary of rewards [B, G]: `reward_mean` (over all B*G), `reward_std` (the within-group
    population std, averaged over groups) and `zero_std_share` (share of groups with no signal)."""
    if rewards.dim() != 2 or rewards.numel() == 0:
        raise ValueError(f"rewards must be a non-empty [B, G] tensor, got shape {tuple(rewards.shape)}")
    r = rewards.float()
    std = r.std(dim=1, unbiased=False)
    return {
        "reward_mean": float(r.mean()),
        "reward_std": float(std.mean()),
        "zero_std_share": float((std <= zero_tol).float().mean()),
    }


# --------------------------------------------------------------------------- log-probs
def labelled_logprobs(model, input_ids: Tensor, attention_mask: Tensor | None, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Log-prob of every labelled next token under `model`.

    input_ids, labels: LongTensor [B, T] (labels unshifted, IGNORE_INDEX where nothing is
    predicted); attention_mask [B, T] (1 = token) or None; rows right-padded (as
    `gti.train.shards.PadCollate` and `gti.rl.rollouts.completion_batch` make them).
    Returns (logp [B, T-1] float32, mask [B, T-1] bool): mask[b, t] = labels[b, t+1] != -100 and
    there logp[b, t] = log_softmax(logits[b, t])[labels[b, t+1]] over the full vocabulary; 0.0
    elsewhere. Differentiable (call under no_grad for old/reference log-probs).

    As in `gti.train.loss.labelled_loss`, the head runs only on the N labelled positions ([N, V]
    float32) when `supports_labelled_loss(model)`; otherwise (and for a DeepSpeed engine, so its
    forward bookkeeping stays in place) the model's own forward gives full [B, T, V] logits.
    """
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} and input_ids {tuple(input_ids.shape)} differ in shape")
    if not is_engine(model) and supports_labelled_loss(model):
        logits, targets, keep = labelled_logits(model, input_ids, attention_mask, labels)  # [N, V], [N]
    else:
        full = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [B, T, V]
        shift = labels[:, 1:].to(full.device)
        keep = shift != IGNORE_INDEX  # [B, T-1]
        logits, targets = full[:, :-1][keep].float(), shift[keep].long()
    lp = F.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [N]
    out_lp = torch.zeros(keep.shape, dtype=lp.dtype, device=lp.device).masked_scatter(keep, lp)
    return out_lp, keep


def sequence_logprobs(logp: Tensor, mask: Tensor) -> Tensor:
    """Sum of the labelled token log-probs per row: [B, T-1] x [B, T-1] -> [B] (a completion's
    log-prob, what beam search calls its score)."""
    return (logp * mask).sum(dim=1)


# --------------------------------------------------------------------------- objective
@dataclass
class GrpoLoss:
    """loss: float32 scalar to minimise. stats: floats for logging: `pg_loss` (the clipped
    surrogate part), `kl` (mean k3 over SID tokens; 0 without a reference), `clip_fraction`
    (share of SID tokens whose ratio was clipped in the direction that matters), `ratio_mean`,
    `tokens` (N, the labelled tokens averaged over)."""

    loss: Tensor
    stats: dict[str, float] = field(default_factory=dict)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(policy || reference) per token: exp(d) - d - 1 with
    d = ref_logp - logp (same shapes in and out); >= 0, exactly 0 (and 0 gradient) where the two
    log-probs are equal."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def grpo_loss(
    logp: Tensor,
    mask: Tensor,
    advantages: Tensor,
    *,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
) -> GrpoLoss:
    """The clipped GRPO objective, a masked mean over the SID tokens:

        loss = mean over labelled tokens of  -( min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)
                                                - kl_coef * k3 )
        ratio = exp(logp - logp_old),  k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1

    with A the advantage of the token's completion (the same for its L tokens) and logp_old the
    log-probs of the policy that produced the rollouts, before any update on them. On policy
    (the first update of a rollout batch, and every update with `rl.updates_per_rollout` 1)
    ratio == 1 in value, nothing is clipped and the gradient is REINFORCE with group baselines;
    later updates of the same batch (`gti.rl.step`) move the ratio off 1, and the clip stops a
    token's ratio from pushing past 1 +- eps in the direction its advantage favours.

    logp: [R, T'] token log-probs under the policy (with grad), e.g. `labelled_logprobs`;
    mask: [R, T'] bool, the tokens that count; advantages: [R], one per completion row (a
    [B, G] tensor `.reshape(-1)`, prompt-major: row b*G + g), or [R, T'] per token;
    old_logp: [R, T'] log-probs of the policy that produced the rollouts (None = on policy:
    logp detached, ratio exactly 1); ref_logp: [R, T'] of the frozen reference (None: no KL
    term, kl_coef must be 0); clip_eps: the ratio is clipped to [1 - clip_eps, 1 + clip_eps].
    Returns `GrpoLoss` (loss = -(mean surrogate) + kl_coef * mean k3; an exact, connected 0
    when no token is labelled).
    """
    if clip_eps < 0:
        raise ValueError(f"clip_eps must be >= 0, got {clip_eps}")
    if ref_logp is None and kl_coef != 0:
        raise ValueError("kl_coef != 0 needs ref_logp (the reference model's log-probs)")
    mask = mask.to(logp.device)
    m = mask.float()
    n = m.sum().clamp_min(1.0)
    adv = advantages.to(logp.device).float()
    if adv.dim() == 1 and adv.shape[0] == logp.shape[0]:
        adv = adv.unsqueeze(1).expand_as(logp)
    elif adv.shape != logp.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} do not fit log-probs {tuple(logp.shape)}: "
                         "pass one per row [R] (a [B, G] tensor flattened) or one per token [R, T']")
    old = logp.detach() if old_logp is None else old_logp.to(logp.device)
    ratio = torch.exp(logp - old)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    pg = -(surrogate * m).sum() / n
    kl = k3_kl(logp, ref_logp.to(logp.device)) if ref_logp is not None else torch.zeros_like(logp)
    kl_mean = (kl * m).sum() / n
    loss = pg + kl_coef * kl_mean
    with torch.no_grad():
        was_clipped = ((ratio < 1.0 - clip_eps) & (adv < 0)) | ((ratio > 1.0 + clip_eps) & (adv > 0))
        stats = {
            "pg_loss": float(pg.detach()),
            "kl": float(kl_mean.detach()),
            "clip_fraction": float((was_clipped & mask).sum() / n),
            "ratio_mean": float((ratio * m).sum() / n),
            "tokens": float(mask.sum()),
        }
    return GrpoLoss(loss=loss, stats=stats)
