"""``stage_fusion``: RLHFuse's stage fusion (Zhong et al. 2024, arXiv 2409.13221).

Inter-stage (``enable``): the rollout hands back finished samples while the long tail still
generates; the reward, the reference's and the actor's log-probs and the critic's values start on
them, and once few samples are left unfinished they move (prompt + tokens so far; the receiver
recomputes their KV cache) onto fewer rollout ranks, so the ranks they leave switch to their
training engines and compute on finished samples (hybridflow/trainer/fused_rollout.py).
Intra-stage (``fuse_actor_critic_update``): with Megatron pipeline parallelism the actor's and
the critic's updates run as one pipeline schedule, the critic's stages laid out in reverse, so
each fills the other's bubbles (workers/engines/megatron_fused.py).

What differs from RLHFuse: it migrates between generation instances and re-deploys models on the
freed GPUs by a planned schedule; here the tail moves within the rollout ranks of the run's own
layout, and a freed rank runs the stages its process already hosts (colocated) or the stages go
to their own pool as chunks arrive (placement=separate).
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.keys import GREATER_THAN_0, POSITIVE, UNIT, key


@dataclass
class StageFusionConfig:
    enable: bool = key(False, "inter-stage fusion: finished samples go on to reward, reference, old log-probs "
                              "and values while the long tail generates, and the tail moves onto fewer rollout "
                              "ranks (rollout.name=vllm, hybrid_engine=true)")
    migrate_below: float = key(0.25, "move the unfinished samples onto fewer rollout ranks once at most this "
                                     "fraction of the batch's samples is left; 0: never move them", UNIT)
    migrate_to: int = key(1, "generation data-parallel ranks that keep the moved tail", POSITIVE)
    slice_s: float = key(0.05, "seconds of engine steps a rollout rank runs between handing back its finished "
                               "samples", GREATER_THAN_0)
    min_chunk: int = key(8, "rows a freed rank takes per inference call while samples still generate (each call "
                            "computes every stage the rank hosts on them)", POSITIVE)
    fuse_actor_critic_update: bool = key(False, "intra-stage fusion: the actor's and the critic's updates in one "
                                                "pipeline schedule, the critic's stages reversed (strategy=megatron "
                                                "for both, the same pp >= 2, colocated)")
