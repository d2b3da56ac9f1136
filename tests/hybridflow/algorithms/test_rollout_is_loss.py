"""The actor objective with verl's rollout-correction weights (``rollout_is_weights`` on the batch):
each token's policy loss is multiplied by its weight before the aggregation."""
import torch

from hybridflow.algorithms.mini_batch_agg import single_batch_meta
from hybridflow.algorithms.objectives import ActorObjective, make_actor_loss_fn
from hybridflow.protocol import DataProto


def test_weights_multiply_each_tokens_policy_loss():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-2.0, -2.0, 0.0, 0.0]])
    w = torch.tensor([[2.0, 1.0, 0.5, 0.0], [1.5, 0.25, 0.0, 0.0]])
    lp = torch.log(torch.full((2, 4), 0.3)).requires_grad_()
    data = DataProto.from_dict({"response_mask": mask, "advantages": adv, "old_log_probs": lp.detach(),
                                "rollout_is_weights": w}, meta_info=single_batch_meta(mask))
    loss, metrics = make_actor_loss_fn(ActorObjective())({"log_probs": lp}, data)
    # ratio 1 (old = current): token loss -A * w; token-mean over the 5 response tokens
    expected = -(2.0 + 1.0 + 0.5 - 3.0 - 0.5) / 5
    assert abs(float(loss.detach()) - expected) < 1e-6
    assert abs(metrics["actor/pg_loss"] - expected) < 1e-6
    loss.backward()
    # d(-ratio * A * w)/d log_prob = -A * w at ratio 1 (inside the clip range), / 5 tokens
    torch.testing.assert_close(lp.grad, -(adv * w * mask) / 5)


def test_no_weights_is_the_plain_loss():
    mask = torch.tensor([[1, 1]])
    lp = torch.zeros(1, 2, requires_grad=True)
    base = {"response_mask": mask, "advantages": torch.tensor([[1.0, 3.0]]), "old_log_probs": lp.detach()}
    loss_fn = make_actor_loss_fn(ActorObjective())
    plain, _ = loss_fn({"log_probs": lp}, DataProto.from_dict(base, meta_info=single_batch_meta(mask)))
    ones, _ = loss_fn({"log_probs": lp}, DataProto.from_dict({**base, "rollout_is_weights": torch.ones(1, 2)},
                                                             meta_info=single_batch_meta(mask)))
    assert float(plain.detach()) == float(ones.detach()) == -2.0
