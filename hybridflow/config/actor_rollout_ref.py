"""``actor_rollout_ref``: the hybrid worker's model, its training (actor), generation (rollout)
and the frozen reference policy (verl's tree and key names).

Batch sizes follow verl: ``actor.ppo_mini_batch_size`` counts *prompts* (the trainer multiplies
it by ``rollout.n``); every ``*_micro_batch_size_per_gpu`` counts *sequences* per worker.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config.common import (PARAM_DTYPES, STRATEGIES, CheckpointContents, FSDPConfig, LoraKeys,
                                      MegatronConfig, OptimConfig)
from hybridflow.config.multi_turn import AgentConfig, MultiTurnConfig
from hybridflow.config.reallocation import ReallocationConfig
from hybridflow.config.speculative import SpeculativeConfig
from hybridflow.config.keys import (GREATER_THAN_0, NON_NEGATIVE, OPEN_UNIT, OPTIONAL_GT_0, OPTIONAL_POSITIVE,
                                    POSITIVE, TOP_K, Range, Registry, key)

DEPRECATED_GLOBAL = "verl's deprecated size over all data-parallel ranks; set: replaces the _per_gpu key"
ROLLOUT_NAMES = ("vllm", "hf")  # workers/rollout/base.py's (a test checks they stay equal)
ROLLOUT_DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: the actor's param_dtype


@dataclass
class ModelConfig(LoraKeys):
    path: str = key("data/models/tiny-qwen2-sft", "the HF checkpoint folder of the policy", path=True)
    tokenizer_path: str | None = key(None, "null: the tokenizer saved with the model", path=True)
    enable_gradient_checkpointing: bool = key(False, "recompute activations in backward (less memory)")
    use_remove_padding: bool = key(False, "pack sequences without padding tokens")
    share_prompt_prefix: bool = key(True, "one forward per distinct prompt, its KV cache shared by its n samples "
                                          "(workers/engines/prefix_sharing.py)")
    group_by_length: bool = key(True, "cut each rank's rows into micro-batches in length order, a prompt's samples "
                                      "together, where that feeds the model fewer padded positions than batch order "
                                      "(long-tailed answers; workers/engines/length_order.py)")
    custom_chat_template: str | None = key(None, "a Jinja chat template replacing the tokenizer's")
    override_config: dict[str, Any] = key({}, "HF config attributes to replace, e.g. "
                                              "+actor_rollout_ref.model.override_config.attention_dropout=0.0")
    external_lib: str | None = key(None, "a module imported (driver and workers) before any model loads")
    use_fused_kernels: bool = key(False, "only false")
    trust_remote_code: bool = key(False, "only false: Llama/Qwen2-family models load without remote code")


@dataclass
class PolicyLossChoice:
    loss_mode: str = key("vanilla", "vanilla (PPO's clipped surrogate; also ppo_clip) | gspo (sequence-level "
                                    "ratio; its policy-gradient term is averaged seq-mean-token-mean whatever "
                                    "loss_agg_mode says, as in verl)",
                         choices=Registry("POLICY_LOSSES", extensible=True))


@dataclass
class ActorConfig:
    strategy: str = key("fsdp", "fsdp | megatron", choices=STRATEGIES)
    ppo_mini_batch_size: int = key(4, "prompts per optimizer step (x rollout.n sequences)", POSITIVE)
    ppo_micro_batch_size_per_gpu: int = key(4, "sequences per forward/backward on one worker", POSITIVE)
    ppo_micro_batch_size: int | None = key(None, DEPRECATED_GLOBAL)
    use_dynamic_bsz: bool = key(False, "micro-batches by token budget instead of row count "
                                       "(workers/engines/token_budget.py)")
    ppo_max_token_len_per_gpu: int = key(16384, "padded tokens per micro-batch with use_dynamic_bsz", POSITIVE)
    ppo_epochs: int = key(1, "passes over each step's batch", POSITIVE)
    recompute_old_log_prob: str = key("auto", "always | skip: no old-log-prob forward, only when strictly on-policy "
                                      "(one optimizer step per batch, no KL in the reward) | auto: skip when it can",
                                      choices=("auto", "always", "skip"))
    shuffle: bool = key(False, "reshuffle sequences between ppo_epochs")
    policy_loss: PolicyLossChoice = key(PolicyLossChoice(), "verl's policy_loss section: the surrogate minimised")
    clip_ratio: float = key(0.2, "PPO's clip range", GREATER_THAN_0)
    clip_ratio_low: float | None = key(None, "null: clip_ratio", OPTIONAL_GT_0)
    clip_ratio_high: float | None = key(None, "null: clip_ratio", OPTIONAL_GT_0)
    # Dual-clip (Ye et al. 2020, eq. 5) bounds the ratio for negative advantages at c > 1.
    clip_ratio_c: float = key(3.0, "dual-clip bound for negative advantages",
                              Range(lambda x: x > 1, "> 1 (the dual-clip bound)"))
    entropy_coeff: float = key(0.0, "weight of the entropy bonus", NON_NEGATIVE)
    use_kl_loss: bool = key(False, "add the KL to the reference policy to the loss")
    kl_loss_coef: float = key(0.001, "weight of the KL loss", NON_NEGATIVE)
    kl_loss_type: str = key("low_var_kl", "k1|kl, abs, k2|mse, k3|low_var_kl", choices=Registry("KL_ESTIMATORS"))
    loss_agg_mode: str = key("token-mean", "token-mean | seq-mean-token-sum | seq-mean-token-mean | "
                                           "seq-mean-token-sum-norm; with policy_loss.loss_mode=gspo it applies "
                                           "to the entropy and KL terms only", choices=Registry("LOSS_AGG_MODES"))
    skip_zero_advantage: bool = key(True, "skip rows whose advantage is 0 everywhere when no entropy or KL term "
                                          "needs them: same step, less work")
    param_dtype: str = key("auto", "auto | fp32 | bf16 (fp32 masters); auto: bf16 where bf16 matmuls are native",
                           choices=PARAM_DTYPES)
    grad_clip: float | None = key(None, "verl's max grad norm key; null: optim.clip_grad")
    ulysses_sequence_parallel_size: int = key(1, "only 1: no sequence parallelism")
    checkpoint: CheckpointContents = key(CheckpointContents(), "what a checkpoint holds")
    optim: OptimConfig = key(OptimConfig(lr=1e-6), "the actor's optimizer")
    fsdp_config: FSDPConfig = key(FSDPConfig(), "only with strategy=fsdp")
    megatron: MegatronConfig = key(MegatronConfig(), "only with strategy=megatron")


@dataclass
class ValKwargsConfig:
    do_sample: bool = key(False, "false: greedy validation (n must be 1)")
    temperature: float = key(0.0, "sampling temperature", NON_NEGATIVE)
    top_p: float = key(1.0, "nucleus sampling mass", OPEN_UNIT)
    top_k: int = key(-1, "-1: off", TOP_K)
    n: int = key(1, "responses per validation prompt", POSITIVE)


@dataclass
class RolloutEngineKwargs:
    vllm: dict[str, Any] = key({}, "passed to vLLM's LLM(...) as is; add keys with +, e.g. "
                                   "+...engine_kwargs.vllm.max_logprobs=5")


@dataclass
class RolloutConfig:  # not workers.rollout.base.RolloutConfig, built by recipes/engine_settings.py
    name: str = key("vllm", "vllm | hf", choices=ROLLOUT_NAMES)
    mode: str = key("sync", "only sync: whole batches through the engine (agent loops too: rollout.multi_turn)")
    n: int = key(1, "responses sampled per prompt", POSITIVE)
    temperature: float = key(1.0, "sampling temperature", NON_NEGATIVE)
    top_p: float = key(1.0, "nucleus sampling mass", OPEN_UNIT)
    top_k: int = key(-1, "-1: off", TOP_K)
    tensor_model_parallel_size: int = key(1, "the generation engine's tensor-parallel size", POSITIVE)
    gpu_memory_utilization: float = key(0.5, "GPU only: the share of GPU memory vLLM may use", OPEN_UNIT)
    kv_cache_gib: float | None = key(None, "CPU only: vLLM's KV cache in GiB (wins over VLLM_CPU_KVCACHE_SPACE); "
                                     "null: what max_num_seqs sequences of the whole context need, at most 1 GiB",
                                     OPTIONAL_GT_0)
    cpu_live_weights: bool = key(True, "CPU only: syncs skip vLLM's kernel rebuild; false saves one weight copy of RAM")
    max_num_seqs: int = key(256, "vLLM's sequences per engine step", POSITIVE)
    max_num_batched_tokens: int | None = key(None, "vLLM's tokens per engine step; null: vLLM's default",
                                             OPTIONAL_POSITIVE)
    enable_chunked_prefill: bool = key(True, "false: a prompt's prefill is never split (the budget must hold "
                                             "prompt + response)")
    enforce_eager: bool = key(True, "vLLM without CUDA graphs")
    dtype: str = key("auto", "auto: the actor's param_dtype | float32 | bfloat16 | float16", choices=ROLLOUT_DTYPES)
    free_cache_engine: bool = key(True, "free vLLM's KV cache while training")
    log_prob_micro_batch_size_per_gpu: int = key(8, "rows per forward of the actor's old log-prob pass", POSITIVE)
    log_prob_micro_batch_size: int | None = key(None, DEPRECATED_GLOBAL)
    log_prob_use_dynamic_bsz: bool | None = key(None, "null: actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int | None = key(None, "null: actor.ppo_max_token_len_per_gpu", OPTIONAL_POSITIVE)
    update_weights_bucket_megabytes: int = key(64, "weight sync: HF tensors alive at once per worker", POSITIVE)
    do_sample: bool = key(True, "false: greedy training rollouts (temperature 0; n must be 1)")
    ignore_eos: bool = key(False, "true: every response runs to data.max_response_length")
    max_model_len: int | None = key(None, "vLLM's context length; null: max_prompt_length + max_response_length")
    prompt_length: int | None = key(None, "verl's copy of data.max_prompt_length: null, or the same value")
    response_length: int | None = key(None, "verl's copy of data.max_response_length: null, or the same value")
    enable_prefix_caching: bool = key(True, "vLLM reuses the KV blocks of a prompt shared by its n samples")
    disable_log_stats: bool = key(True, "vLLM's periodic throughput log lines")
    load_format: str = key("auto", "auto: vLLM reads the checkpoint | dummy: random init, the first weight "
                                   "sync fills it")
    engine_kwargs: RolloutEngineKwargs = key(RolloutEngineKwargs(), "verl's rollout.engine_kwargs")
    val_kwargs: ValKwargsConfig = key(ValKwargsConfig(), "sampling for validation")
    speculative: SpeculativeConfig = key(SpeculativeConfig(), "speculative decoding (RLHFSpec): drafts verified by "
                                                             "the policy itself; outputs keep its distribution")
    reallocation: ReallocationConfig = key(ReallocationConfig(), "RLHFSpec's sample reallocation between "
                                                                 "generation ranks")
    multi_turn: MultiTurnConfig = key(MultiTurnConfig(), "multi-turn, tool-using rollouts (agent loops)")
    agent: AgentConfig = key(AgentConfig(), "which agent loop a row without an agent_name column runs")


@dataclass
class RefMegatronConfig:
    param_offload: bool = key(False, "GPU: the frozen reference rests in host memory between passes")


@dataclass
class RefConfig:
    strategy: str | None = key(None, "verl's; the reference runs on the actor's strategy (null or the same)")
    log_prob_micro_batch_size_per_gpu: int = key(8, "rows per forward of the reference pass", POSITIVE)
    log_prob_micro_batch_size: int | None = key(None, DEPRECATED_GLOBAL)
    log_prob_use_dynamic_bsz: bool | None = key(None, "null: actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int | None = key(None, "null: actor.ppo_max_token_len_per_gpu", OPTIONAL_POSITIVE)
    fsdp_config: FSDPConfig = key(FSDPConfig(), "with actor.strategy=fsdp")
    megatron: RefMegatronConfig = key(RefMegatronConfig(), "with actor.strategy=megatron (the actor's sizes)")


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = key(True, "true: actor and rollout share each worker; false: the rollout runs "
                                         "on a pool of its own (rollout.*, async_training.*)")
    model: ModelConfig = key(ModelConfig(), "the policy's model")
    actor: ActorConfig = key(ActorConfig(), "training the policy")
    rollout: RolloutConfig = key(RolloutConfig(), "generation")
    ref: RefConfig = key(RefConfig(), "the frozen reference policy")
