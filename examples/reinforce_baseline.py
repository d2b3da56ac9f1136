"""A new algorithm in a page, written against the worker groups: REINFORCE with a per-prompt
leave-one-out baseline (Williams 1992; the baseline of Kool et al. 2019), no clipping, no critic.

    python examples/reinforce_baseline.py [config overrides...]   (defaults: the demo's data/model)

The dataflow is the program: generate -> score -> advantages on the controller -> update.
With one on-policy optimizer step per batch, the PPO surrogate's gradient at ratio 1 is exactly
the REINFORCE gradient, so the actor worker's update_actor is reused unchanged.
"""
import sys

import ray
import torch

from hybridflow.config import derive, load_config, validate
from hybridflow.data import ResumablePromptLoader, RLPromptDataset
from hybridflow.protocol import DataProto
from hybridflow.rewards import make_reward_manager
from hybridflow.tiny import load_tokenizer
from hybridflow.trainer.placement import build_worker_groups
from recipes.build import role_specs
from recipes.cli import compose_config
from recipes.worker_env import ray_runtime_env


def main(overrides):
    cfg = load_config(compose_config("grpo", ["actor_rollout_ref.rollout.n=4",
                                              "actor_rollout_ref.actor.use_kl_loss=false",
                                              "trainer.n_gpus_per_node=2", *overrides]))
    n = cfg.actor_rollout_ref.rollout.n  # samples per prompt: the leave-one-out baseline needs >= 2
    a = cfg.actor_rollout_ref.actor
    a.ppo_mini_batch_size = cfg.data.train_batch_size  # one optimizer step per batch: on-policy
    validate(cfg)
    tok = load_tokenizer(cfg.actor_rollout_ref.model.path)
    data = RLPromptDataset.from_config(cfg.data.train_files, tok, cfg.data)
    loader = ResumablePromptLoader(data, cfg.data.train_batch_size, seed=cfg.data.seed)
    fn = cfg.custom_reward_function
    reward = make_reward_manager(fn.path, fn.name, fn.reward_kwargs, timeout_s=fn.timeout_s)
    ray.init(address="local", include_dashboard=False, runtime_env=ray_runtime_env(cfg))
    main_roles, _ = role_specs(cfg, derive(cfg, len(data)))
    groups, _ = build_worker_groups(cfg, main_roles, {}, use_gpu=False)
    actor = groups["actor_rollout_ref"]
    actor.init_model()

    for step in range(1, (cfg.trainer.total_training_steps or 10) + 1):
        batch = DataProto.from_single_dict(loader.next_batch())
        prompts = batch.select(["input_ids", "attention_mask", "position_ids"], [], [])
        prompts.meta_info["n"] = n
        out = actor.generate_sequences(prompts)                       # [B*n] responses
        out.meta_info.pop("metrics", None)
        resp, mask = out.batch["responses"], out.batch["response_mask"]
        texts = [tok.decode(r[: int(m.sum())].tolist(), skip_special_tokens=True) for r, m in zip(resp, mask)]
        nt = batch.repeat(n).non_tensor_batch
        scores = torch.tensor(reward(texts, mask.sum(-1).tolist(), resp.shape[1], list(nt["data_source"]),
                                     list(nt["ground_truth"])).scores).view(-1, n)
        baseline = (scores.sum(1, keepdim=True) - scores) / (n - 1)    # leave-one-out mean
        adv = (scores - baseline).view(-1, 1) * mask                     # same advantage on every token
        out.batch["advantages"] = adv.float()
        out.union(actor.compute_log_prob(out))                           # ratio 1 at the update
        metrics = actor.update_actor(out)[0]
        print(f"step {step}: score {scores.mean():.3f}  pg_loss {metrics['actor/pg_loss']:+.4f}  "
              f"grad_norm {metrics['actor/grad_norm']:.3f}")
    actor.save_hf(f"{cfg.trainer.default_local_dir}/hf")                 # an ordinary HF checkpoint
    print(f"saved {cfg.trainer.default_local_dir}/hf")
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
