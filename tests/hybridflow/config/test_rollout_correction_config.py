"""algorithm.rollout_correction: verl's defaults (off), auto's old-log-prob forward when it is on,
and one-line errors naming the key for settings the math would refuse."""
import pytest

from hybridflow.config import load_config
from tests.hybridflow.config.validate_helpers import error_of, grpo

RC = "algorithm__rollout_correction__"


def test_defaults_are_verls_and_off():
    rc = load_config({}).algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize, rc.rollout_rs,
            rc.rollout_rs_threshold) == (None, 2.0, False, None, None)


@pytest.mark.parametrize("rc, expected", [
    ({}, "skip"),  # strictly on-policy: no separate forward
    ({"rollout_is": "token"}, "always"),  # the weights are pi_old / pi_rollout: pi_old is computed
    ({"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": 2.0}, "always"),
])
def test_a_correction_needs_the_old_log_prob_forward(rc, expected):
    cfg = load_config({"data": {"train_batch_size": 4}, "algorithm": {"rollout_correction": rc},
                       "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4}}})
    assert cfg.actor_rollout_ref.actor.recompute_old_log_prob == expected


@pytest.mark.parametrize("overrides, needle", [
    ({RC + "rollout_is": "tokens"},
     "algorithm.rollout_correction.rollout_is='tokens' is unknown (did you mean 'token'?)"),
    ({RC + "rollout_is_threshold": 0.0}, "algorithm.rollout_correction.rollout_is_threshold"),
    ({RC + "rollout_rs": "geometric"}, "algorithm.rollout_correction.rollout_rs='geometric' is unknown"),
    ({RC + "rollout_rs": "token_k1"}, "rollout_rs=token_k1 needs algorithm.rollout_correction.rollout_rs_threshold"),
    ({RC + "rollout_rs": "token_k2", RC + "rollout_rs_threshold": "0.5_2"},
     "algorithm.rollout_correction.rollout_rs_threshold='0.5_2': token_k2 takes one upper bound, not a range"),
    ({RC + "rollout_rs_threshold": 2.0}, "rollout_rs_threshold=2.0 is used only by rollout rejection"),
    ({RC + "rollout_is": "token", "actor_rollout_ref__actor__ppo_mini_batch_size": 8,
      "actor_rollout_ref__actor__use_kl_loss": False, "actor_rollout_ref__actor__recompute_old_log_prob": "skip"},
     "actor_rollout_ref.actor.recompute_old_log_prob=skip computes no old log-probs: use auto or always"),
])
def test_wrong_settings_fail_naming_the_key(overrides, needle):
    msg = error_of(grpo(**overrides), check_paths=False)
    assert needle in msg, msg
    assert "strictly on-policy update" not in msg  # one message for the skip, not two


def test_a_valid_correction_passes():
    from hybridflow.config import validate
    validate(grpo(**{RC + "rollout_is": "sequence", RC + "rollout_rs": "seq_mean_k1,token_k3",
                     RC + "rollout_rs_threshold": "0.5_2.0,1.0", RC + "rollout_is_batch_normalize": True}),
             check_paths=False)
