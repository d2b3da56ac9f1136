"""What an engine's HF model must be so that its log-probs are the vLLM policy's, on architectures
beyond the Llama family: no dropout (GPT-2 ships 0.1 everywhere), Gemma-2's softcapped attention,
MoE weights streamed in the checkpoint's layout rather than transformers 5's fused one, and a
critic for a causal LM transformers has no token-classification class for (OLMo2)."""
import pytest
import torch
from safetensors import safe_open

from hybridflow.tiny import char_vocab, save_char_tokenizer
from workers.engines.hf_export import in_checkpoint_layout
from workers.engines.hf_model import load_hf_model

VOCAB = len(char_vocab())


def _save(path, model_type: str, **kw) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=VOCAB, **kw)).float()
    model.save_pretrained(str(path))
    save_char_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("gpt2"), "gpt2", n_embd=64, n_layer=2, n_head=2, n_positions=64)


def test_rl_roles_train_without_dropout(gpt2):
    ids = torch.arange(3, 19).unsqueeze(0)
    for role in ("actor", "critic"):
        model = load_hf_model(gpt2, role).train()  # the engines train in train mode
        assert model.config.resid_pdrop == model.config.attn_pdrop == model.config.embd_pdrop == 0.0
        assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
        first, second = model(ids).logits, model(ids).logits
        assert torch.equal(first, second)  # deterministic: the training forward scores vLLM's policy


def test_sft_keeps_the_checkpoints_dropout(gpt2):
    model = load_hf_model(gpt2, "actor", disable_dropout=False)
    assert model.config.resid_pdrop == 0.1
    assert any(m.p == 0.1 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_gemma2_runs_the_attention_that_applies_its_softcapping(tmp_path):
    path = _save(tmp_path / "gemma2", "gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    assert load_hf_model(path, "actor").config._attn_implementation == "eager"
    assert load_hf_model(_save(tmp_path / "gpt2", "gpt2", n_embd=64, n_layer=1, n_head=2),
                         "actor").config._attn_implementation != "eager"


def test_moe_weights_stream_in_the_checkpoints_layout(tmp_path):
    path = _save(tmp_path / "mixtral", "mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
    model = load_hf_model(path, "actor")
    assert any(name.endswith("experts.gate_up_proj") for name in model.state_dict())  # transformers' fused layout
    streamed = dict(in_checkpoint_layout(model, model.state_dict().items()))
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        assert set(streamed) == set(f.keys())  # block_sparse_moe.experts.N.w1.weight, ... as on disk
        for name in f.keys():
            assert torch.equal(streamed[name], f.get_tensor(name)), name
    # a model transformers loads unchanged streams its state_dict as it is
    dense = load_hf_model(_save(tmp_path / "gpt2", "gpt2", n_embd=64, n_layer=1, n_head=2), "actor")
    assert [n for n, _ in in_checkpoint_layout(dense, dense.state_dict().items())] == list(dense.state_dict())


def test_a_critic_for_an_architecture_without_a_token_classification_class(tmp_path):
    from transformers import AutoModel

    path = _save(tmp_path / "olmo2", "olmo2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1)
    critic = load_hf_model(path, "critic")
    assert type(critic).__name__ == "Olmo2ForTokenClassification" and critic.config.num_labels == 1
    backbone = AutoModel.from_pretrained(path, dtype=torch.float32)
    ids = torch.arange(3, 13).unsqueeze(0)
    with torch.no_grad():  # the checkpoint's backbone under a new per-token score
        assert torch.allclose(critic(ids).logits, critic.score(backbone(ids).last_hidden_state), atol=1e-6)
    assert type(load_hf_model(_save(tmp_path / "gpt2", "gpt2", n_embd=64, n_layer=1, n_head=2),
                              "critic")).__name__ == "GPT2ForTokenClassification"  # transformers' own


def test_an_hf_export_generates_with_its_cache(gpt2, tmp_path):
    from transformers import AutoConfig

    from workers.engines.hf_export import write_hf_checkpoint

    model = load_hf_model(gpt2, "actor")
    model.config.use_cache = False  # as the engines set it for training
    tensors = [(n, t) for n, t in model.state_dict().items() if n != "lm_head.weight"]  # tied: as the engine streams
    write_hf_checkpoint(str(tmp_path / "hf"), tensors, model.config, "GPT2LMHeadModel", gpt2)
    assert AutoConfig.from_pretrained(str(tmp_path / "hf")).use_cache is True
    assert model.config.use_cache is False  # the engine's own config is left as it was


def test_override_config_attn_implementation_builds_that_attention(tmp_path):
    """verl's ``override_config.attn_implementation`` reaches from_pretrained (a config attribute
    would be ignored); eager scores the same log-probs as SDPA on left-padded, grouped rows through
    the shared-prompt path the update takes, and its gradients stay finite on padding."""
    from tests.workers.engines.fsdp_helpers import make_grouped_rl_batch
    from workers.engines import prefix_sharing

    path = _save(tmp_path / "qwen2", "qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    b = make_grouped_rl_batch(3, 2, 6, 5, VOCAB).batch
    ids, mask, pos = b["input_ids"], b["attention_mask"], b["position_ids"]
    outs = {}
    for impl in ("eager", "sdpa"):
        model = load_hf_model(path, "actor", {"attn_implementation": impl})
        assert model.config._attn_implementation == impl
        shared = prefix_sharing.distinct_prompts(ids, mask, pos, 0, 6)
        logits = prefix_sharing.shared_prefix_logits(model, ids, mask, pos, 0, 6, 11, *shared)
        logits.float().log_softmax(-1).mul(b["response_mask"].unsqueeze(-1)).sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        outs[impl] = logits.log_softmax(-1)[b["response_mask"].bool()]
    assert torch.allclose(outs["eager"], outs["sdpa"], atol=1e-5)
    assert load_hf_model(path, "critic", {"attn_implementation": "eager"}).config._attn_implementation == "eager"
