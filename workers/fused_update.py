"""``update_actor_and_critic``: PPO's actor and critic updates as one fused pipeline schedule
(RLHFuse's intra-stage fusion, arXiv 2409.13221; workers/engines/megatron_fused.py).

A mixin for the actor's worker class (``ActorRolloutRefWorker``). It needs the critic worker
hosted in the same process (hybridflow/controller/colocate.py gives each role instance the dict of
its sibling instances as ``_colocated_roles``), both on Megatron with the same tp and pp >= 2 and
the critic's pipeline reversed (``reverse_pipeline=true``). It does what ``update_actor`` and
``update_critic`` do, one optimizer step per mini-batch, with the same metric keys (``actor/*``,
``critic/*``; ``timing_s/update_fused_worker`` replaces the two workers' timings), and the same
weights after it as calling them one after the other.

Mini-batches are paired in order: the actor's k-th with the critic's k-th (each role cuts the rows
by its own ppo_mini_batch_size, ppo_epochs, shuffle and seed). Where one role has more mini-batches
than the other (different mini-batch sizes or epochs), its extra ones run alone after the pairs,
with its plain ``train_batch``.
"""
from __future__ import annotations

import itertools
import time

from hybridflow.controller import Dispatch, register
from hybridflow.protocol import DataProto
from workers import ppo_update


class FusedActorCriticUpdate:
    """Mixin: ``self.s`` / ``self.engine`` are the actor worker's settings and engine."""

    def _fused_critic(self):
        from workers.engines.megatron_fused import check_fusable

        critic = (getattr(self, "_colocated_roles", None) or {}).get("critic")
        if critic is None:
            raise ValueError("update_actor_and_critic needs the critic worker in the same process as the actor: "
                             "colocate the critic role with actor_rollout_ref (one resource pool), or call "
                             "update_critic and update_actor")
        if self.engine is None or critic.engine is None:
            raise ValueError("update_actor_and_critic: init_model the actor and the critic first")
        check_fusable(self.engine, critic.engine)
        return critic

    @register(dispatch_mode=Dispatch.mesh("actor"))
    def update_actor_and_critic(self, data: DataProto) -> dict[str, float]:
        """``update_actor(data)`` and ``update_critic(data)`` in one fused schedule per mini-batch
        pair; ``data`` carries both roles' inputs (advantages, old log-probs; values, returns)."""
        from workers.engines.megatron_fused import fused_train_batch

        critic = self._fused_critic()
        actor_s, critic_s = self.s, critic.s
        ppo_update.prepare_actor_batch(actor_s, data)
        actor_minis = ppo_update.mini_batches("update_actor_and_critic (actor)", actor_s, data, self.engine.dp_size)
        critic_minis = ppo_update.mini_batches("update_actor_and_critic (critic)", critic_s, data,
                                               critic.engine.dp_size)
        actor_loss, critic_loss = ppo_update.actor_loss_fn(actor_s), ppo_update.critic_loss_fn(critic_s)
        t0 = time.perf_counter()
        means = ppo_update.MetricMeans()
        for a_mini, c_mini in itertools.zip_longest(actor_minis, critic_minis):
            a_skip = ppo_update.actor_skip_rows(actor_s, a_mini) if a_mini is not None else None
            if a_mini is not None and c_mini is not None:
                a_step, c_step = fused_train_batch(self.engine, a_mini, actor_loss, critic.engine, c_mini,
                                                   critic_loss, actor_skip_rows=a_skip)
            else:  # the longer role's extra mini-batches (see the module docstring)
                a_step = self.engine.train_batch(a_mini, actor_loss, skip_rows=a_skip) if a_mini is not None else None
                c_step = critic.engine.train_batch(c_mini, critic_loss) if c_mini is not None else None
            if a_step is not None:
                means.add("actor", ppo_update.actor_step_metrics(a_step, a_mini))
            if c_step is not None:
                means.add("critic", c_step)
        self._weights_stale = True  # the rollout syncs before it next generates
        metrics = means.means()
        metrics["timing_s/update_fused_worker"] = time.perf_counter() - t0
        return metrics
