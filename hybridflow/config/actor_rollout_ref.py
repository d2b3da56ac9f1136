"""``actor_rollout_ref``: the hybrid worker's model, its training (actor), generation (rollout)
and the frozen reference policy (verl's tree and key names).

Batch sizes follow verl: ``actor.ppo_mini_batch_size`` counts *prompts* (the trainer multiplies
it by ``rollout.n``); every ``*_micro_batch_size_per_gpu`` counts *sequences* per worker.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.config.common import CheckpointContents, FSDPConfig, LoraKeys, MegatronConfig, OptimConfig, path_field


@dataclass
class ModelConfig(LoraKeys):  # LoRA: lora_rank, lora_alpha, target_modules, exclude_modules
    path: str = path_field("data/models/tiny-qwen2-sft")
    tokenizer_path: str | None = path_field(None)  # None: the tokenizer saved with the model
    enable_gradient_checkpointing: bool = False
    use_remove_padding: bool = False
    # run each distinct prompt of a micro-batch once and share its KV cache among its samples
    # (exact; FSDP padded layout and Megatron): workers/engines/prefix_sharing.py
    share_prompt_prefix: bool = True
    custom_chat_template: str | None = None  # a Jinja chat template replacing the tokenizer's
    # HF config attributes replaced before the model is built (training engines and vLLM), e.g.
    # +actor_rollout_ref.model.override_config.attention_dropout=0.0
    override_config: dict[str, Any] = field(default_factory=dict)
    external_lib: str | None = None  # a module imported (driver and workers) before any model loads
    # verl keys accepted at their "off" value only (verl_keys.unsupported_errors says why)
    use_liger: bool = False
    use_fused_kernels: bool = False
    trust_remote_code: bool = False


@dataclass
class PolicyLossChoice:
    """verl's ``actor.policy_loss`` section: which surrogate the actor minimises."""

    loss_mode: str = "vanilla"  # vanilla (PPO clip; also "ppo_clip") | gspo: hybridflow.algorithms.POLICY_LOSSES


@dataclass
class ActorConfig:
    strategy: str = "fsdp"  # fsdp | megatron
    ppo_mini_batch_size: int = 4  # prompts per optimizer step (x rollout.n sequences)
    ppo_micro_batch_size_per_gpu: int = 4  # sequences per forward/backward on one worker
    ppo_micro_batch_size: int | None = None  # verl's deprecated size over all data-parallel ranks
    # micro-batches by token budget instead of row count (workers/engines/token_budget.py)
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384  # padded tokens per micro-batch with use_dynamic_bsz
    ppo_epochs: int = 1
    # auto: skip the separate old-log-prob forward when the update is strictly on-policy (one
    # optimizer step per batch: ppo_epochs 1, one mini-batch, no KL in the reward); always: always run it
    recompute_old_log_prob: str = "auto"
    shuffle: bool = False  # reshuffle sequences between ppo_epochs
    policy_loss: PolicyLossChoice = field(default_factory=PolicyLossChoice)
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None  # None: clip_ratio
    clip_ratio_high: float | None = None  # None: clip_ratio
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages; must be > 1
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    loss_agg_mode: str = "token-mean"
    # leave out rows whose advantage is 0 on every token when no entropy or KL loss term needs
    # them: the same step (the loss is normalised over the whole mini-batch), less compute
    skip_zero_advantage: bool = True
    # auto | fp32 | bf16 (bf16 compute, fp32 master weights). auto: bf16 where bf16 matmuls are
    # native (GPUs; CPUs where a timed one beats fp32), else fp32 (derived.resolve_param_dtype)
    param_dtype: str = "auto"
    grad_clip: float | None = None  # verl's key for the max grad norm; None: optim.clip_grad
    ulysses_sequence_parallel_size: int = 1  # verl's key; only 1 (no sequence parallelism)
    # verl compiles its log-prob/entropy kernels with torch.compile; the engines here run eager.
    # Accepted, either value, so verl scripts run unchanged
    use_torch_compile: bool = True
    checkpoint: CheckpointContents = field(default_factory=CheckpointContents)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class ValKwargsConfig:
    """Sampling for validation; ``do_sample=False`` is greedy (then ``n`` must be 1)."""

    do_sample: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1


@dataclass
class RolloutEngineKwargs:
    """Extra keyword arguments for the generation engine's constructor, passed through as given
    (verl's ``rollout.engine_kwargs``; add keys with ``+``: ``+...engine_kwargs.vllm.max_logprobs=5``)."""

    vllm: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutConfig:
    """Generation settings. Not ``workers.rollout.base.RolloutConfig`` (the engine's own
    dataclass): ``hybridflow.config.rollout_engine_kwargs`` builds that one's arguments."""

    name: str = "vllm"  # vllm | hf
    mode: str = "sync"  # verl's key; only sync (whole batches through the engine, no agent loop server)
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    tensor_model_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float = 1.0  # vLLM's KV cache on CPU, in GiB (fractions too; wins over VLLM_CPU_KVCACHE_SPACE)
    # CPU: vLLM keeps plain weights next to its packed kernels so a sync skips the rebuild
    # (workers/rollout/vllm_weight_sync.py); false saves that copy of the weights in RAM
    cpu_live_weights: bool = True
    max_num_seqs: int = 256
    # vLLM's scheduler: tokens per engine step (None: vLLM's default for the device) and
    # whether a long prompt's prefill may be split over steps (off: the budget must hold
    # prompt + response)
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enforce_eager: bool = True
    dtype: str = "auto"  # auto (the actor's resolved param_dtype) | float32 | bfloat16 | float16
    free_cache_engine: bool = True
    log_prob_micro_batch_size_per_gpu: int = 8  # old log-prob recomputation on the actor
    log_prob_micro_batch_size: int | None = None  # verl's deprecated size over all data-parallel ranks
    log_prob_use_dynamic_bsz: bool | None = None  # None: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: int | None = None  # None: actor.ppo_max_token_len_per_gpu
    # weight sync: full-size HF tensors alive at once per worker (verl's key)
    update_weights_bucket_megabytes: int = 64
    do_sample: bool = True  # false: greedy training rollouts (temperature 0; then n must be 1)
    ignore_eos: bool = False  # true: every response runs to data.max_response_length
    max_model_len: int | None = None  # vLLM's context length; None: max_prompt_length + max_response_length
    # verl's copies of data.max_prompt_length / max_response_length (its YAML interpolates them);
    # set, they must agree: the data keys are the ones read
    prompt_length: int | None = None
    response_length: int | None = None
    enable_prefix_caching: bool = True  # vLLM reuses cached KV blocks of shared prompt prefixes
    disable_log_stats: bool = True  # vLLM's periodic throughput log lines
    load_format: str = "auto"  # auto: vLLM reads the checkpoint | dummy: random init, the first sync fills it
    engine_kwargs: RolloutEngineKwargs = field(default_factory=RolloutEngineKwargs)
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)


@dataclass
class RefMegatronConfig:
    """With ``actor.strategy=megatron`` the reference policy has the actor's parallel sizes; verl's
    ``ref.megatron.param_offload`` is the one key of its own (see ``FSDPConfig``)."""

    param_offload: bool = False


@dataclass
class RefConfig:
    strategy: str | None = None  # verl's; the reference runs on the actor's strategy (null or the same)
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_micro_batch_size: int | None = None  # verl's deprecated size over all data-parallel ranks
    log_prob_use_dynamic_bsz: bool | None = None  # None: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: int | None = None  # None: actor.ppo_max_token_len_per_gpu
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)  # with actor.strategy=fsdp
    megatron: RefMegatronConfig = field(default_factory=RefMegatronConfig)  # with actor.strategy=megatron


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True  # verl's key; only true (actor and rollout share each worker)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
