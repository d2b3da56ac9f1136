"""The fusion bench's pure parts (scripts/bench/fusion.py): both stage runs are configs that pass the
checks before start-up, are PPO with a critic, a reference and old log-probs, greedy at equal rows
by default, and differ only in stage fusion."""
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench")
sys.path.insert(0, BENCH)
import fusion  # noqa: E402


@pytest.mark.parametrize("argv, greedy", [([], True), (["--sampled"], False)])
def test_both_runs_are_valid_ppo_configs_that_differ_in_fusion_only(argv, greedy):
    from hybridflow.config import load_config, validate
    from hybridflow.config.derived import derive
    from longtail import recipe_overrides
    from recipes.cli import compose_config

    args = fusion.parse_args([*argv, "--work-dir", "/tmp/unused"])
    paths = {"model": "/m", "data": "/d"}
    cfgs = {}
    for name, extra in (("unfused", ()), ("fused", fusion.fused_keys(args))):
        cfg = load_config(compose_config("grpo", [*recipe_overrides(args, paths), *fusion.ppo_keys(args), *extra]))
        validate(cfg, check_paths=False, available_slots=2)
        cfgs[name] = cfg
    for cfg in cfgs.values():
        d = derive(cfg)
        assert d.use_critic and d.use_reference and cfg.actor_rollout_ref.actor.recompute_old_log_prob == "always"
        assert d.sequences_per_step == args.prompts * args.samples  # the same rows either way
        assert cfg.actor_rollout_ref.rollout.do_sample is not greedy
    assert (cfgs["unfused"].stage_fusion.enable, cfgs["fused"].stage_fusion.enable) == (False, True)
