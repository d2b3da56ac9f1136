"""verl's deprecated global micro-batch sizes become the per-GPU keys (divided by the role's
data-parallel size, as verl's workers do), or fail in one line naming the key and the fix."""
import pytest

from hybridflow.config import ConfigError, derive, load_config, validate


def run_config(**sections):
    tree = {"algorithm": {"adv_estimator": "gae"}, "data": {"train_batch_size": 8},
            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4}, "rollout": {"n": 2}},
            "trainer": {"n_gpus_per_node": 4}}
    for section, values in sections.items():
        node, *path = section.split("__")
        cur = tree.setdefault(node, {})
        for part in path:
            cur = cur.setdefault(part, {})
        cur.update(values)
    return load_config(tree)


def test_global_micro_batch_sizes_are_divided_by_each_roles_data_parallel_size():
    cfg = run_config(actor_rollout_ref__actor={"ppo_micro_batch_size": 8},
                     actor_rollout_ref__rollout={"log_prob_micro_batch_size": 12},
                     actor_rollout_ref__ref={"log_prob_micro_batch_size": 4},
                     critic={"ppo_micro_batch_size": 4, "forward_micro_batch_size": 16,
                             "megatron": {"tensor_model_parallel_size": 2}, "strategy": "megatron"},
                     reward_model={"micro_batch_size": 6},
                     trainer={"placement": "separate", "separate_pool_gpus_per_node": 2})
    validate(cfg, check_paths=False)
    arr = cfg.actor_rollout_ref
    # actor, rollout and ref: 4 data-parallel ranks; critic: 2 workers / tp 2 = 1; reward model: 2 workers
    assert (arr.actor.ppo_micro_batch_size_per_gpu, arr.rollout.log_prob_micro_batch_size_per_gpu,
            arr.ref.log_prob_micro_batch_size_per_gpu) == (2, 3, 1)
    assert (cfg.critic.ppo_micro_batch_size_per_gpu, cfg.critic.forward_micro_batch_size_per_gpu) == (4, 16)
    assert cfg.reward_model.micro_batch_size_per_gpu == 3
    assert arr.actor.ppo_micro_batch_size is None  # converted once: validating again is a no-op
    validate(cfg, check_paths=False)
    assert arr.actor.ppo_micro_batch_size_per_gpu == 2
    assert derive(cfg).actor_micro_batches_per_mini == 1  # 4 prompts x 2 / 4 ranks = 2 rows, 2 per micro


def test_a_global_size_that_does_not_split_over_the_ranks_names_the_per_gpu_key():
    cfg = run_config(actor_rollout_ref__actor={"ppo_micro_batch_size": 6})
    with pytest.raises(ConfigError) as err:
        validate(cfg, check_paths=False)
    message = str(err.value)
    assert "actor_rollout_ref.actor.ppo_micro_batch_size=6" in message and "4 data-parallel ranks" in message
    assert "set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu instead" in message
