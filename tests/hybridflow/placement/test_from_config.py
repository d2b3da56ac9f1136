"""The planner's inputs from a run's config and its plans back as config (hybridflow/placement/from_config.py):
every plan offered for ``trainer.placement=auto`` on 2 slots is a config that validates and builds the
pools and layouts the plan describes; plans the runtime does not build are refused by name."""
import pytest

from hybridflow.config import ConfigError, load_config, validate
from hybridflow.placement.devices import DeviceProfile
from hybridflow.placement.from_config import LocalPlanError, apply_plan, workload_from_config
from hybridflow.placement.plans import Plan, Pool, RoleLayout
from recipes.cli import compose_config

# rates of one 1-thread slot of an AMD EPYC (calibrate.py's measure, 2026-11-27), so the plans ranked
# here are the ones trainer.placement=auto ranks on that machine
MEASURED = {"fwd_flops": {"fp32": 9.0e10, "bf16": 3.7e11}, "train_flops": {"fp32": 6.7e10, "bf16": 2.7e11},
            "decode_flops": {"fp32": 9.9e10, "bf16": 2.3e11}, "decode_step_s": 8e-3,
            "decode_step_s_by_dtype": {"fp32": 8e-3, "bf16": 5.4e-3}, "collective_latency_s": 1.8e-4, "threads": 1}
CPU = DeviceProfile("cpu-1t", {"fp32": 1.1e11, "bf16": 5.0e11}, 12e9, 4.3e10, 1.5e9, 1.5e9, "test", MEASURED)


def load(overrides):
    return load_config(compose_config("ppo", overrides))


def test_workload_reads_models_and_batch(ppo_overrides):
    w = workload_from_config(load(ppo_overrides))
    assert (w.actor.hidden, w.actor.layers, w.actor.heads, w.actor.kv_heads, w.actor.ffn) == (64, 2, 4, 2, 128)
    assert w.critic == w.actor.__class__(**{**vars(w.actor), "name": "critic"})  # the actor's model, a value head
    assert w.reference and w.reward_model is not None
    assert (w.prompts, w.samples_per_prompt, w.prompt_len, w.response_len, w.mini_batches) == (8, 2, 16, 8, 1)
    assert w.param_bytes == 2 and w.micro_batch == 4 and not w.recompute
    assert w.old_log_prob is False  # one mini-batch, one epoch: the runtime skips pi_old's forward
    assert w.extra["role_bytes"] == {"reward_model": 4, "critic": 2}  # the reward model worker computes in fp32


def test_every_local_candidate_validates_and_runs_its_plan(ppo_overrides, monkeypatch):
    from hybridflow.placement import auto

    monkeypatch.setattr(auto, "device_calibration", lambda *a, **k: ({"device": CPU, "constants": {}}, "test"))
    cfg = load(ppo_overrides + ["trainer.placement=auto"])
    result = auto.plan_config(cfg, keep_combos=64)
    seen = set()
    for cand in result.candidates:
        planned = load(ppo_overrides + cand.overrides)
        validate(planned, available_slots=2, check_paths=False)
        plan, t = cand.estimate.plan, planned.trainer
        seen.add(plan.placement)
        main = plan.pools[0]
        assert t.n_gpus_per_node == main.slots and t.cpus_per_worker == cfg.trainer.cpus_per_worker
        assert t.placement == plan.placement.split("+")[0]
        if t.placement == "separate":
            assert t.separate_pool_gpus_per_node == plan.pools[1].slots
        assert planned.reward_model.enable_resource_pool == plan.placement.endswith("+rm-pool")
        actor = plan.layouts["actor"]
        assert planned.actor_rollout_ref.actor.strategy == actor.strategy
        if actor.strategy == "megatron":
            assert planned.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == actor.tp
        else:
            assert planned.actor_rollout_ref.actor.fsdp_config.fsdp_size == (1 if actor.fsdp_shard == 1 else -1)
        assert planned.actor_rollout_ref.rollout.tensor_model_parallel_size == plan.rollout.tp
    assert seen == {"colocate", "separate", "colocate+rm-pool"}
    assert any(c.estimate.plan.layouts["actor"].strategy == "megatron" for c in result.candidates)
    # the ranking is the planner's: fastest predicted first
    steps = [c.estimate.step_s for c in result.candidates]
    assert steps == sorted(steps)


def test_plans_the_runtime_does_not_build_are_refused(ppo_overrides):
    cfg = load(ppo_overrides)
    fsdp = RoleLayout(1, 1, 1, 1, "fsdp")
    layouts = {r: fsdp for r in ("actor", "ref", "critic", "reward_model")}
    split = Plan((Pool("actor", 1, ("actor", "ref")), Pool("critic", 1, ("critic", "reward_model"))), layouts)
    with pytest.raises(LocalPlanError, match="split is planned but not built here"):
        apply_plan(cfg, split)
    one = Pool("main", 2, ("actor", "ref", "critic", "reward_model"))
    ref_own = dict(layouts, actor=RoleLayout(2, 1, 1, 1, "megatron"), ref=RoleLayout(1, 1, 2, 1, "fsdp"))
    with pytest.raises(LocalPlanError, match="reference runs in the actor's strategy"):
        apply_plan(cfg, Plan((one,), ref_own))
    rm_tp = dict(layouts, reward_model=RoleLayout(2, 1, 1, 1, "megatron"))
    with pytest.raises(LocalPlanError, match="reward model worker runs replicated"):
        apply_plan(cfg, Plan((one,), rm_tp))


def test_auto_errors_before_planning(ppo_overrides):
    from hybridflow.placement.auto import plan_config

    with pytest.raises(ConfigError, match="hybrid_engine=false"):
        plan_config(load(ppo_overrides + ["trainer.placement=auto", "actor_rollout_ref.hybrid_engine=false"]))
    with pytest.raises(ConfigError, match="ray_init.address"):
        plan_config(load(ppo_overrides + ["trainer.placement=auto", "ray_init.address=auto"]))
    # a config that reaches validation still saying auto was never planned
    with pytest.raises(ConfigError, match="trainer.placement=auto is decided by the recipe"):
        validate(load(ppo_overrides + ["trainer.placement=auto"]), available_slots=2, check_paths=False)
