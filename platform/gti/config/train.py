"""The training sections of the run config: the optimiser settings grounding, SFT and RL share.

What it is for: `TrainConfig`, what grounding and SFT share (optimiser, schedule, parallelism,
precision, checkpoints, validation cadence), and each one's own defaults: `GroundConfig`
(`ground:`) and `SftConfig` (`sft:`, with LC-Rec multitask mixing, `LoraConfig`, validation
users and the prompt style). `RlConfig` (`rl:`, GRPO after SFT, off by default). `gti.config.RunConfig` holds
them; `gti.vocab_ground` reuses `GroundConfig`.

What it does NOT know: the other sections or YAML loading (`gti.config`, `gti.config.io`), or
how training runs (`gti.train`). It never imports ray or torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from gti.config.io import StrictModel

MAX_TRAIN_FAILURES = 100  # the most restarts `ground/sft.max_failures` may ask for


class TrainConfig(StrictModel):
    """Shared by grounding and SFT: optimiser, schedule, parallelism, checkpoints."""

    enabled: bool = Field(True, description="train this stage (false, or steps 0: export the model unchanged)")
    lr: float = Field(1e-3, gt=0, description="peak learning rate (AdamW)")
    steps: int = Field(100, ge=0, description="optimizer steps")
    batch_size: int = Field(8, gt=0, description="global batch (sequences per optimizer step)")
    grad_accum: int = Field(1, ge=1, description="micro-batches accumulated per optimizer step")
    warmup_steps: int = Field(0, ge=0, description="steps of linear warmup to lr")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="lr after warmup: constant, or cosine / linear decay over the steps")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping by global norm")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas (each in [0, 1))")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    num_workers: int = Field(1, ge=1, description="Ray Train workers (data-parallel)")
    use_gpu: bool = Field(False, description="one GPU per worker")
    resources_per_worker: dict[str, float] | None = Field(
        None, description="Ray resources per Train worker, e.g. {CPU: 8, GPU: 1}, or {CPU: 1, gti_worker: 1} with "
        "cluster/local_cluster.sh for one worker per node (None: Ray Train's default, 1 CPU plus 1 GPU when "
        "use_gpu)")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage (0: plain data parallel)")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="bf16 = autocast; auto: bf16 where native (CUDA, CPUs with AVX512-BF16/AMX), else fp32 "
        "(resolved value in the stage manifest); master weights and optimizer state stay fp32 unless "
        "model.dtype is bfloat16")
    group_by_length: bool = Field(
        True, description="micro-batches of similar-length rows (gti.train.batching), so padding costs little")
    attn_implementation: Literal["auto", "sdpa", "eager"] = Field(
        "auto", description="attention kernel while training; auto: eager on CPU (its backward was faster for short "
        "rows; bench/RESULTS.md), the model's own choice on GPU")
    cpu_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads per CPU training worker (None: Ray's setting, the CPUs the "
        "worker reserved, 1 by default); set it to the node's cores for a single worker on a laptop")
    checkpoint_every: int = Field(50, ge=1, description="steps between checkpoints (and one at the last step)")
    val_every: int = Field(50, ge=1, description="steps between validations (and one at the last step)")
    val_samples: int = Field(
        64, ge=1, description="grounding: held-out text->SID pairs validated (seeded sample); SFT uses sft.val_users")
    max_failures: int = Field(
        0, ge=0, le=MAX_TRAIN_FAILURES, description="worker-group restarts after a worker failure (Ray Train "
        "FailureConfig); bounded, as retrying for ever would loop on a failure that recurs")
    log_every: int = Field(1, ge=1, description="steps between metric reports")


class GroundConfig(TrainConfig):
    """`ground:`: training of the new SID rows on the grounding pairs."""

    lr: float = Field(1e-3, gt=0, description="peak learning rate (AdamW)")
    steps: int = Field(200, ge=0, description="optimizer steps")


class LoraConfig(StrictModel):
    """`sft.lora:`: peft adapters on every linear layer of the backbone (embeddings and head
    stay fully trainable)."""

    enabled: bool = Field(False, description="train LoRA adapters instead of the full backbone")
    r: int = Field(8, gt=0, description="adapter rank")
    alpha: int = Field(32, gt=0, description="adapter scale numerator (scale = alpha / r)")
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the adapter input")
    quantize_4bit: bool = Field(False, description="QLoRA: 4-bit base weights (needs bitsandbytes, a GPU and enabled)")


class SftConfig(TrainConfig):
    """`sft:`: fine-tuning to recommend the next item's SID from a user's history."""

    lr: float = Field(3e-4, gt=0, description="peak learning rate (AdamW)")
    steps: int = Field(200, ge=0, description="optimizer steps")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "cosine", description="lr after warmup: constant, or cosine / linear decay over the steps")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay")
    max_len: int = Field(160, gt=8, description="tokens per rendered prompt + answer; longer histories are cut")
    multitask: bool = Field(False, description="LC-Rec style: mix grounding pairs into the SFT rows")
    multitask_weight: float = Field(
        0.5, ge=0, description="grounding-pair rows added per sequence row when multitask is on")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA / QLoRA adapters")
    val_users: int = Field(64, ge=1, description="validation users (seeded sample) scored at every validation")
    val_mrr: bool = Field(
        False, description="also the exact-rank MRR of the validation users at every validation (gti.eval.rank: "
        "one prefill plus one token per distinct SID prefix per user); val_loss is always computed")
    prompt_style: Literal["chat", "compact"] = Field(
        "chat", description="chat: chat template, system prompt and a retrieval template around the history (the "
        "paper's form); compact: the history's SID tokens alone, then the answer (gti.lm.templates."
        "render_rec_prompt); used by SFT, evaluate and recommend. Ignored with objective: sequence")
    objective: Literal["window", "sequence"] = Field(
        "window", description="window: one row per (history of <= data.max_history items, next item), the loss on "
        "that one target; sequence: a user's training items as SID tokens back to back in chunks of <= "
        "data.max_history + 1 items (consecutive chunks share one item, so every target is trained once per "
        "epoch), the loss on every item after the first: one forward pass trains every target of the chunk. "
        "Prompts everywhere (evaluate, recommend, serve, infer, rl) are then the bare history SIDs "
        "(gti.lm.templates.render_sequence_prompt); sft.prompt_style does not apply")
    freeze_layers: int = Field(
        0, ge=0, description="the first N decoder layers (and the token embedding's input side) stay as grounded: "
        "backward stops at layer N, so a step costs less, and fewer weights fit the small SFT data; with tied "
        "embeddings the SID rows still train through the output head (gti.lm.regularise)")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="dropout on the token embeddings and the attention probabilities while SFT "
        "trains (the pretrained decoder has none)")
    epochs: float | None = Field(
        None, gt=0, description="budget in passes over the SFT training rows: steps = ceil(epochs * rows / "
        "batch_size), resolved once the rows exist (recorded in the stage's facts); None: `steps` as given")

    @property
    def render_style(self) -> str:
        """How prompts and rows are rendered (`gti.lm.templates.PROMPT_RENDERERS` key): the prompt
        style of the window objective, "sequence" for the sequence objective."""
        return "sequence" if self.objective == "sequence" else self.prompt_style


class RlConfig(TrainConfig):
    """`rl:`: GRPO after SFT (gti.rl, gti.train.rl_task): per rollout, `group_size` candidate
    SIDs per training prompt from the policy under the trie, rewards against the prompt's
    target, group-normalised advantages; then `updates_per_rollout` optimizer steps on that
    batch, each minimising the clipped objective (ratio to the policy before the first of them)
    plus a KL penalty to the SFT model. `steps` counts optimizer steps."""

    enabled: bool = Field(False, description="run RL after SFT (off: the SFT model is the run's model)")
    lr: float = Field(1e-5, gt=0, description="peak learning rate (AdamW)")
    steps: int = Field(50, ge=0, description="optimizer steps; a rollout batch serves `updates_per_rollout` "
                       "consecutive ones (with 1: each step rolls out, rewards and updates once)")
    batch_size: int = Field(8, gt=0, description="global batch: training prompts per optimizer step")
    checkpoint_every: int = Field(10, ge=1, description="steps between checkpoints (and one at the last step)")
    val_every: int = Field(10, ge=1, description="steps between validations on SFT's validation users (and one "
                           "before the first step and one at the last); their exact MRR picks the best checkpoint")
    group_size: int = Field(8, ge=2, description="G: candidate SIDs rolled out per prompt (advantages are "
                            "normalised within these groups)")
    rollout: Literal["beam", "sample"] = Field(
        "beam", description="beam: the G best distinct items of the constrained beam search; sample: G draws "
        "level by level under the trie at `temperature`")
    beam_width: int | None = Field(None, ge=1, description="beam rollouts: beams (None: group_size)")
    temperature: float = Field(1.0, gt=0, description="sample rollouts: softmax temperature")
    reward: str | dict[str, float] = Field(
        "hit", description="hit (1 for the target), rank (rank-aware: wrong candidates above the target are "
        "penalised by their rank), prefix (share of the target's leading SID levels matched), or weights of them, "
        "e.g. {hit: 1.0, prefix: 0.5} (gti.rl.rewards)")
    clip_eps: float = Field(0.2, ge=0, description="policy ratio (to the policy that rolled out) clipped to "
                            "[1 - clip_eps, 1 + clip_eps]; binds only with updates_per_rollout > 1")
    updates_per_rollout: int = Field(
        1, ge=1, description="optimizer steps per rollout batch (PPO/GRPO's inner iterations): step 1 is on policy "
        "(ratio 1), the later ones reuse the batch with the clipped ratio to the policy before step 1; 1: on-policy "
        "REINFORCE with group baselines (clip_eps never binds). The micro-batches of the later steps are not "
        "rolled out (their prompts go unused); checkpoint_every must be a multiple of it, so a resume starts "
        "on a fresh rollout")
    kl_coef: float = Field(0.04, ge=0, description="weight of the KL penalty to the SFT model (0: no reference "
                           "model is loaded)")
    rollout_batch: int = Field(8, ge=1, description="prompts per rollout forward pass")
    stop_margin: float | None = Field(
        0.02, ge=0, description="stop when the validation MRR falls this far below the SFT model's (measured "
        "before the first step; None: never stop early); the best checkpoint by validation MRR is exported, "
        "the SFT model itself when no step beat it")

    @property
    def trains(self) -> bool:
        """Whether the rl stage trains (and so whether `rl/model` is the run's model)."""
        return bool(self.enabled and self.steps > 0)

    @field_validator("reward")
    @classmethod
    def _known_reward(cls, v: str | dict[str, float]) -> str | dict[str, float]:
        from gti.rl.rewards import parse_reward_spec  # torch-free: names and weights only

        parse_reward_spec(v)
        return v

    @field_validator("updates_per_rollout")
    @classmethod
    def _rollouts_end_at_checkpoints(cls, v: int, info: ValidationInfo) -> int:
        # A checkpoint holds no rollout batch: a run resumed mid-batch could not finish that
        # batch's updates against the old log-probs it was rolled out with, so checkpoints
        # must fall on rollout boundaries (then resumed == uninterrupted, as for SFT).
        every = info.data.get("checkpoint_every")
        if every is not None and every % v != 0:
            raise ValueError(f"rl.checkpoint_every ({every}) must be a multiple of rl.updates_per_rollout ({v}): "
                             "a checkpoint cannot hold a half-used rollout batch")
        return v
