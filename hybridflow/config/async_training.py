"""verl's keys of a rollout on its own pool: ``rollout`` (the pool's size, verl's one-step-off and
fully-async recipes) and ``async_training`` (how far generation may run ahead of training).

They apply with ``actor_rollout_ref.hybrid_engine=false``; with the hybrid engine (the default) the
actor and its rollout share each worker and these keys are unused. What differs from verl's fully-
async trainer: the trainer still trains whole batches of ``data.train_batch_size`` prompts, one
step after another; the rollout pool runs ahead of it by up to ``staleness_threshold`` batches
(hybridflow/trainer/async_rollout.py), which at 1 is verl's one-step-off policy.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.keys import NON_NEGATIVE, POSITIVE, key


@dataclass
class RolloutPoolConfig:
    nnodes: int = key(1, "hybrid_engine=false: nodes of the rollout pool", POSITIVE)
    n_gpus_per_node: int = key(1, "hybrid_engine=false: the rollout pool's slots per node (GPUs; on CPU worker "
                                  "slots), apart from trainer.n_gpus_per_node", POSITIVE)


@dataclass
class AsyncTrainingConfig:
    staleness_threshold: float = key(0.0, "hybrid_engine=false: batches the rollout pool may generate ahead of "
                                          "the trainer with the weights it has; 0: the pools take turns, 1: "
                                          "one-step-off, 0.5: half of the next batch", NON_NEGATIVE)
    trigger_parameter_sync_step: int = key(1, "hybrid_engine=false: training steps between weight syncs to the "
                                              "rollout pool", POSITIVE)
    partial_rollout: bool = key(True, "hybrid_engine=false: at a weight sync, samples still generating go on "
                                      "with the new weights (false: they finish with the old ones)")
    use_rollout_log_probs: bool = key(False, "hybrid_engine=false: the rollout's own log-probs are pi_old (no "
                                             "trainer forward; verl's bypass); false: the trainer recomputes them")
