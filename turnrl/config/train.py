"""The algorithm and the trainer: `algo.*` (rollout correction, group filters), `optim.*`, `trainer.*`, `sft.*`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from turnrl.config.checks import positive
from turnrl.config.loader import ConfigError


@dataclass
class RolloutCorrectionConfig:
    """Engine/trainer mismatch correction (turnrl/algo/rollout_correction.py): truncated IS weights, rejection
    of tokens or sequences whose ratio pi_trainer / pi_engine leaves [rs_low, rs_high], and a veto."""
    is_level: Literal["token", "sequence"] | None = None   # IS weights min(ratio, is_cap) per token / sequence
    is_cap: float = 2.0
    rs_level: Literal["token", "sequence", "geometric"] | None = None   # rejection statistic
    rs_high: float | None = None         # keep ratios <= rs_high (required with rs_level)
    rs_low: float | None = None          # keep ratios >= rs_low (default 1 / rs_high)
    veto: float | None = None            # reject a sequence holding a token with ratio < veto (e.g. 1e-4)

    def validate(self) -> None:
        positive("is_cap", self.is_cap)
        if self.rs_level is not None and (self.rs_high is None or self.rs_high <= 0):
            raise ConfigError(f"'rs_level: {self.rs_level}' needs 'rs_high' > 0 (e.g. 2.0; rs_low defaults to "
                              "1 / rs_high).")
        if self.rs_low is not None and (self.rs_low <= 0 or (self.rs_high is not None and self.rs_low > self.rs_high)):
            raise ConfigError(f"need 0 < rs_low <= rs_high, got rs_low={self.rs_low}, rs_high={self.rs_high}.")
        if self.veto is not None:
            positive("veto", self.veto)


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling (turnrl/train/dynamic_sampling.py): drop groups whose samples all score the same
    and sample more prompts until the step has data.prompts_per_step groups with signal."""
    enable: bool = False
    metric: str = "reward"               # reward | accuracy | the name of a reward part
    max_rounds: int = 4                  # rollout rounds per step, the first included (0: no limit)
    prompts_per_round: int | None = None  # prompts each round samples (default data.prompts_per_step)

    def validate(self) -> None:
        positive("max_rounds", self.max_rounds, allow_zero=True)
        if self.prompts_per_round is not None:
            positive("prompts_per_round", self.prompts_per_round)


LOSS_MODES = ("ppo", "gspo", "cispo", "gmpo")


@dataclass
class AlgoConfig:
    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"] = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    turn_level: bool = False             # per-turn discounted returns instead of one broadcast reward
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    kl_coef: float = 0.0
    kl_type: Literal["k1", "k2", "k3", "mse", "low_var_kl"] = "low_var_kl"
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    tis_cap: float | None = None         # truncated importance sampling for engine/trainer mismatch
    value_clip: float = 0.2
    value_coef: float = 0.5
    loss_mode: Literal["ppo", "gspo", "cispo", "gmpo"] = "ppo"   # policy loss (turnrl/algo/policy_losses.py)
    correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)

    def validate(self) -> None:
        positive("clip_low", self.clip_low)
        if self.loss_mode in ("gspo", "gmpo") and self.loss_agg == "token-mean":
            raise ConfigError(f"loss_mode {self.loss_mode} averages per sequence, then over sequences: set "
                              "'loss_agg' to seq-mean-token-mean.")
        if self.loss_mode != "ppo" and self.dual_clip is not None:
            raise ConfigError(f"'dual_clip' is PPO's; loss_mode {self.loss_mode} does not use it: set it to null.")
        if self.loss_mode == "ppo" and self.clip_low >= 1:
            raise ConfigError(f"'clip_low' must be < 1 with loss_mode ppo, got {self.clip_low}.")
        if self.tis_cap is not None and self.correction.is_level is not None:
            raise ConfigError("'tis_cap' is token-level IS: set either it or 'correction.is_level'/'is_cap', not "
                              "both.")
        positive("clip_high", self.clip_high)
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"'dual_clip' must be > 1 (e.g. 3.0), got {self.dual_clip}.")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ConfigError("'gamma' and 'lam' must be in [0, 1].")
        positive("kl_coef", self.kl_coef, allow_zero=True)
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ConfigError(f"'tis_cap' must be >= 1, got {self.tis_cap}.")


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    fused_master_step: Literal["auto", "on", "off"] = "auto"  # AdamW on the fp32 masters of bf16 weights writes
    #                                      the weights in the same kernel (turnrl/train/master_adamw.py); auto = on
    #                                      where masters are stepped on a GPU (1 ms an update less on an H100,
    #                                      2026-12-08), else torch's AdamW and the copy; on: an error where no
    #                                      masters are stepped on a GPU

    def validate(self) -> None:
        positive("lr", self.lr)
        if len(self.betas) != 2:
            raise ConfigError(f"'betas' must have two numbers, got {self.betas}.")


@dataclass
class TrainerConfig:
    removed_keys: ClassVar[dict[str, str]] = {"log_every": "metrics are logged every step; remove the key"}
    steps: int = 10
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # the weights the models compute with: bfloat16
    #                                      = bf16 weights + fp32 master weights (turnrl/train/master.py); auto =
    #                                      bfloat16 on GPUs under bf16 autocast (local and Ray ranks), else float32
    optim: OptimConfig = field(default_factory=OptimConfig)
    epochs_per_step: int = 1             # PPO epochs over each rollout batch
    mini_batches: int = 1                # optimizer steps per epoch
    micro_batch_tokens: int = 4096       # token budget of one forward/backward
    fused_head: Literal["auto", "on", "off"] = "auto"  # chunked logprobs of policy tokens only, no full logits
    #                                      (auto = on; off: the model's own logits path)
    compile: bool = False                # torch.compile each decoder layer (GPU)
    fuse_linears: bool = False           # with compile: linears that read one input (q/k/v, gate/up, LoRA's A)
    #                                      run as one GEMM a group (turnrl/train/fuse_linears.py); off: 10 ms an
    #                                      update slower on an H100 (2026-12-07: the backward's cat costs more)
    fused_mlp: bool = False              # SwiGLU MLPs with the activation inside their GEMMs (GPU, bf16 weights, no
    #                                      LoRA on the MLP; turnrl/train/swiglu_kernel.py); off: its Triton GEMMs
    #                                      made an update 14 ms slower on an H200 (2026-12-07)
    fused_projections: Literal["auto", "on", "off"] = "auto"  # q/k/v and gate/up as one GEMM each, rotary and
    #                                      SwiGLU in kernels that write the fused gradients whole (GPU, 16-bit
    #                                      weights, no LoRA on them; attention with packed_attention triton;
    #                                      turnrl/train/fused_projections.py); auto = on for the local trainer on
    #                                      CUDA with 16-bit weights, without engine.exact or fused_mlp (4 ms an
    #                                      update less on an H100, 2026-12-08); on: an error where nothing fuses
    packing: bool = False                # micro-batches as packed rows, no padding (GPU: varlen flash attention)
    packed_attention: Literal["auto", "flash", "triton"] = "auto"  # packed rows' attention on GPUs: torch's
    #                                      varlen FA2, or turnrl's Triton kernels (turnrl/train/flash_kernel.py);
    #                                      auto = triton where its kernels take the model's head size, else flash
    shared_prefix: bool = True           # a group's shared prompt runs once per micro-batch (not with packing or
    #                                      gradient checkpointing; exact: turnrl/train/shared_prefix.py)
    retain_host_memory: bool = True      # CPU training: malloc keeps freed memory (no page faults per micro-batch)
    save_every: int = 0                  # 0 = only at the end
    keep_checkpoints: int = 2
    eval_every: int = 0
    resume: str | None = None            # "latest" or a checkpoint directory
    overwrite: bool = False              # a new run into an output_dir holding one deletes it (else: an error)
    trajectories_per_step_saved: int = 16
    max_masked_steps: int = 3            # stop after this many steps in a row with every trajectory masked (0: never)
    # Scale-out on Ray (turnrl/distributed): local = this process only
    placement: Literal["local", "colocated", "split"] = "local"  # colocated: engines share the trainer's GPUs
    nodes: int = 1
    gpus_per_node: int | None = None     # None: the Ray cluster's GPUs / nodes (0: CPU actors, gloo)
    ranks: int = 0                       # training ranks (0: colocated every GPU, split the GPUs engines leave, CPU 1)
    ray_address: str | None = None       # an existing cluster (ray://... or host:port); None: start Ray here
    cpus_per_actor: float = 1.0
    weight_sync: Literal["auto", "object_store", "broadcast", "ipc"] = "auto"
    async_rollout: bool = False          # engines sample step k+1 while the trainer updates on step k
    max_staleness: int = 1               # async: a batch trains at most this many policy versions after sampling
    carry_over: int = 0                  # async: a batch closes once prompts_per_step groups finished; the rest
    #                                      run on into the next batches, at most this many (staleness + this)

    def validate(self) -> None:
        positive("steps", self.steps)
        positive("epochs_per_step", self.epochs_per_step)
        positive("mini_batches", self.mini_batches)
        positive("micro_batch_tokens", self.micro_batch_tokens)
        positive("save_every", self.save_every, allow_zero=True)
        positive("eval_every", self.eval_every, allow_zero=True)
        positive("nodes", self.nodes)
        if self.gpus_per_node is not None:
            positive("gpus_per_node", self.gpus_per_node, allow_zero=True)
        positive("ranks", self.ranks, allow_zero=True)
        positive("cpus_per_actor", self.cpus_per_actor)
        positive("max_staleness", self.max_staleness, allow_zero=True)
        positive("carry_over", self.carry_over, allow_zero=True)
        if self.carry_over and not self.async_rollout:
            raise ConfigError("'carry_over' lets groups run on while the trainer updates: set 'async_rollout: true' "
                              "(placement split) or 'carry_over: 0'.")
        positive("max_masked_steps", self.max_masked_steps, allow_zero=True)
        if self.param_dtype == "bfloat16" and self.dtype == "float32":
            raise ConfigError("'param_dtype: bfloat16' computes in bf16 under bf16 autocast: set 'dtype' to bfloat16 "
                              "or auto, or 'param_dtype' to float32.")
        if self.packed_attention == "triton" and not self.packing:
            raise ConfigError(f"'packed_attention: {self.packed_attention}' applies to packed micro-batches only: "
                              "set 'packing: true' or remove 'packed_attention'.")
        if self.packing and self.placement != "local":
            raise ConfigError("'packing' runs in the local trainer only: set 'packing' to false with placement "
                              f"{self.placement}.")
        if self.fused_projections == "on" and self.placement != "local":
            raise ConfigError("'fused_projections: on' runs in the local trainer only: set 'fused_projections' to "
                              f"auto or off with placement {self.placement}.")
        if self.fused_projections == "on" and self.fused_mlp:
            raise ConfigError("'fused_projections: on' and 'fused_mlp' both replace the MLP: set "
                              "'fused_projections' to auto or off, or 'fused_mlp' to false.")
        if self.optim.fused_master_step == "on" and self.placement != "local":
            raise ConfigError("'optim.fused_master_step: on' steps the local trainer's fp32 masters (the Ray ranks "
                              f"keep FSDP2's): set it to auto or off with placement {self.placement}.")
        if self.fused_mlp and self.placement != "local":
            raise ConfigError(f"'fused_mlp' runs in the local trainer only: set 'fused_mlp' to false with placement "
                              f"{self.placement}.")
        if self.placement == "local" and (self.async_rollout or self.nodes > 1 or self.ranks > 1):
            raise ConfigError("'async_rollout', 'nodes' > 1 and 'ranks' > 1 run on Ray: set 'placement' to split "
                              "(engines and trainer on their own GPUs) or colocated.")
        if self.async_rollout and self.placement == "colocated":
            raise ConfigError("'async_rollout' needs engines that keep running while the trainer updates: set "
                              "'placement: split' (colocated engines sleep during updates).")
        if self.async_rollout and self.max_staleness < 1:
            raise ConfigError("'max_staleness' must be >= 1 with 'async_rollout' (0 is the synchronous loop).")


@dataclass
class SFTConfig:
    """Supervised fine-tuning on conversations (and rejection-sampling rounds); uses trainer.optim etc."""
    epochs: int = 1
    batch_size: int = 16                 # conversations per optimizer step
    max_length: int = 2048               # longer conversations are skipped and counted
    rounds: int = 0                      # > 0: rejection sampling: collect -> filter -> SFT, this many times
    prompts_per_round: int = 32
    min_reward: float = 1.0              # acceptance threshold for rejection sampling
    export_dir: str | None = None        # the merged final model (default OUTPUT_DIR/model)

    def validate(self) -> None:
        positive("epochs", self.epochs)
        positive("batch_size", self.batch_size)
        positive("max_length", self.max_length)
        positive("rounds", self.rounds, allow_zero=True)
        positive("prompts_per_round", self.prompts_per_round)
