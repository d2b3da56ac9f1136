"""Non-finite numbers in the config (issue 30): ``actor_rollout_ref.actor.optim.lr=inf`` passed
its ``> 0`` range and trained on NaN. Every float of the tree, keys without a range row included,
must be finite; the one-line error names the key."""
import math

import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.config.ranges import non_finite_errors, range_errors
from hybridflow.config.sft import SFTConfig, load_sft_config, validate_sft
from recipes.cli import compose_config
from tests.hybridflow.config.validate_helpers import error_of, grpo, run_dir  # noqa: F401  (a fixture)


@pytest.mark.parametrize("override,key", [
    ("actor_rollout_ref.actor.optim.lr=inf", "actor_rollout_ref.actor.optim.lr=inf"),
    ("actor_rollout_ref.actor.optim.lr=nan", "actor_rollout_ref.actor.optim.lr=nan"),
    ("actor_rollout_ref.actor.optim.lr=-inf", "actor_rollout_ref.actor.optim.lr=-inf"),
    ("critic.optim.betas=[0.9,nan]", "critic.optim.betas[1]=nan"),
    ("algorithm.kl_ctrl.kl_coef=inf", "algorithm.kl_ctrl.kl_coef=inf"),
    ("actor_rollout_ref.actor.clip_ratio_c=inf", "actor_rollout_ref.actor.clip_ratio_c=inf"),
    ("actor_rollout_ref.rollout.temperature=nan", "actor_rollout_ref.rollout.temperature=nan"),
    ("trainer.call_timeout_s=inf", "trainer.call_timeout_s=inf"),
    # free-form dicts are walked too: a NaN rope_theta would build a NaN model
    ("+actor_rollout_ref.model.override_config.rope_theta=nan",
     "actor_rollout_ref.model.override_config.rope_theta=nan"),
])
def test_a_non_finite_value_is_named_in_one_line(override, key):
    cfg = load_config(compose_config("grpo", [override]))
    assert range_errors(cfg) == [f"{key} must be a finite number, not inf or nan"]


def test_validate_refuses_it_before_anything_else(run_dir):
    """Through ``validate``, the way the entry point calls it: one line, the key named once
    (nan also fails 'must be > 0', which would not say what is wrong)."""
    message = error_of(grpo(actor_rollout_ref__actor__optim__lr=math.inf, critic__optim__eps=math.nan),
                       available_slots=2)
    assert message == ("actor_rollout_ref.actor.optim.lr=inf must be a finite number, not inf or nan; "
                       "critic.optim.eps=nan must be a finite number, not inf or nan")


@pytest.mark.parametrize("name", ["ppo", "grpo", "remax"])
def test_the_shipped_recipes_hold_only_finite_numbers(name):
    assert non_finite_errors(load_config(compose_config(name, []))) == []


def test_the_sft_recipe_refuses_it_too():
    assert non_finite_errors(load_sft_config(compose_config("sft", [], schema=SFTConfig))) == []
    cfg = load_sft_config(compose_config("sft", ["optim.lr=inf", "optim.betas=[nan,0.999]"], schema=SFTConfig))
    with pytest.raises(ConfigError) as err:
        validate_sft(cfg, check_paths=False)
    assert str(err.value) == ("optim.lr=inf must be a finite number, not inf or nan; "
                              "optim.betas[0]=nan must be a finite number, not inf or nan")
