"""The reward model reads its score at each sequence's last attended token, even where the pad id
is EOS (transformers' pooling would read the token before the EOS a response ends with) or the
checkpoint has no pad id at all (transformers refuses the batch)."""
import torch

from workers.reward_model import last_token_scores


def _reward_model(pad_token_id):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=pad_token_id)
    return LlamaForSequenceClassification(cfg).eval()


def _batch(eos: int):
    # row 0: left-padded prompt, response ending in EOS then right padding; row 1: no padding at all
    ids = torch.tensor([[eos, 5, 6, 7, 8, eos, eos], [4, 5, 6, 9, 10, 11, eos]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_scores_are_read_at_the_last_attended_token_when_pad_is_eos():
    eos = 2
    model = _reward_model(pad_token_id=eos)
    ids, mask, pos = _batch(eos)
    with torch.no_grad():
        per_token = model.score(model.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state)
        got = last_token_scores(model, ids, mask, pos)
        pooled_by_transformers = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, 0]
    assert torch.allclose(got, per_token[[0, 1], [5, 6], 0], atol=1e-6)  # the EOS positions
    assert not torch.allclose(pooled_by_transformers, got)  # transformers read the tokens before them


def test_a_reward_model_without_a_pad_id_scores_a_batch():
    model = _reward_model(pad_token_id=None)
    ids, mask, pos = _batch(2)
    model.config.pad_token_id = 0  # what the worker sets: transformers refuses a batch otherwise
    with torch.no_grad():
        assert last_token_scores(model, ids, mask, pos).shape == (2,)
