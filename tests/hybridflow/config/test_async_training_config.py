"""hybrid_engine=false (the rollout on a pool of its own): verl's keys, the slots both pools take,
the old-log-prob forward that stale samples need, and one-line errors naming the key."""
import pytest

from hybridflow.config import load_config, validate
from hybridflow.config.derived import derive
from tests.hybridflow.config.validate_helpers import error_of, grpo

OWN_POOL = {"actor_rollout_ref__hybrid_engine": False, "trainer__n_gpus_per_node": 1}


def test_defaults_keep_the_hybrid_engine():
    cfg = load_config({})
    assert cfg.actor_rollout_ref.hybrid_engine is True
    assert (cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node) == (1, 1)
    at = cfg.async_training
    assert (at.staleness_threshold, at.trigger_parameter_sync_step, at.partial_rollout,
            at.use_rollout_log_probs) == (0.0, 1, True, False)
    assert derive(cfg).rollout_world == 0


def test_a_rollout_pool_counts_its_slots():
    cfg = grpo(**OWN_POOL, rollout__n_gpus_per_node=2, actor_rollout_ref__rollout__tensor_model_parallel_size=2)
    d = derive(cfg)
    assert (d.actor_world, d.rollout_world, d.rollout_dp, d.total_workers) == (1, 2, 1, 3)
    validate(cfg, check_paths=False)
    msg = error_of(cfg, check_paths=False, available_slots=2)
    assert "rollout.nnodes*rollout.n_gpus_per_node=2" in msg and "needs 3 workers" in msg, msg


@pytest.mark.parametrize("async_keys, expected", [
    ({}, "skip"),  # staleness 0, sync every step: the samples are the trainer's own policy's
    ({"staleness_threshold": 1.0}, "always"),  # one-step-off: pi_old is not the sampler's policy
    ({"trigger_parameter_sync_step": 2}, "always"),
])
def test_stale_samples_need_the_old_log_prob_forward(async_keys, expected):
    cfg = load_config({"data": {"train_batch_size": 4}, "actor_rollout_ref": {
        "hybrid_engine": False, "actor": {"ppo_mini_batch_size": 4}}, "async_training": async_keys})
    assert cfg.actor_rollout_ref.actor.recompute_old_log_prob == expected


@pytest.mark.parametrize("overrides, needle", [
    ({"actor_rollout_ref__rollout__name": "hf"}, "only actor_rollout_ref.rollout.name=vllm can"),
    ({"rollout__n_gpus_per_node": 3, "actor_rollout_ref__rollout__tensor_model_parallel_size": 2},
     "must divide the rollout pool's rollout.nnodes*rollout.n_gpus_per_node=3 workers: use one of [1, 3]"),
    ({"async_training__use_rollout_log_probs": True, "algorithm__rollout_correction__rollout_is": "token"},
     "pi_old/pi_rollout are all 1"),
    ({"async_training__staleness_threshold": -0.5}, "async_training.staleness_threshold"),
    ({"async_training__trigger_parameter_sync_step": 0}, "async_training.trigger_parameter_sync_step"),
])
def test_wrong_settings_fail_naming_the_key(overrides, needle):
    msg = error_of(grpo(**OWN_POOL, **overrides), check_paths=False)
    assert needle in msg, msg


def test_verls_keys_with_no_effect_here_load_at_their_values_only():
    load_config({"async_training": {"require_batches": 1, "checkpoint_engine": {"enable": True}}})
    with pytest.raises(Exception, match="async_training.require_batches=2: the trainer takes whole batches"):
        load_config({"async_training": {"require_batches": 2}})


def test_the_hybrid_engine_ignores_the_rollout_pool():
    """rollout.* sizes only the pool hybrid_engine=false starts; with the hybrid engine, a rollout TP
    that does not divide rollout.n_gpus_per_node is no error."""
    validate(grpo(rollout__n_gpus_per_node=3), check_paths=False)


@pytest.mark.parametrize("overrides", [{"algorithm__rollout_correction__bypass_mode": True},
                                       {**OWN_POOL, "async_training__use_rollout_log_probs": True}])
def test_bypass_takes_pi_old_from_the_rollout(overrides):
    from hybridflow.config.resolve import bypass_old_log_prob

    cfg = grpo(**overrides, actor_rollout_ref__actor__ppo_mini_batch_size=8, actor_rollout_ref__actor__use_kl_loss=False)
    validate(cfg, check_paths=False)
    assert bypass_old_log_prob(cfg)
    assert cfg.actor_rollout_ref.actor.recompute_old_log_prob == "always"  # the update reads old_log_probs
    msg = error_of(grpo(**overrides, algorithm__rollout_correction__rollout_is="token"), check_paths=False)
    assert "makes pi_old the rollout's own log-probs" in msg, msg


def test_use_rollout_log_probs_needs_a_rollout_pool_of_its_own():
    from hybridflow.config.resolve import bypass_old_log_prob

    assert not bypass_old_log_prob(grpo(async_training__use_rollout_log_probs=True))
