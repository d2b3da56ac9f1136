"""A model vLLM serves through its Transformers backend (OLMo2 here; also GPT-NeoX, Phi, Starcoder2,
SmolLM3, ...) in the hybrid worker's layout: the training engine's HF model and the vLLM engine in
one process. vLLM decorates transformers' decoder class in place while it builds the engine; the
rollout gives the class back, so the training model built before keeps working (it raised
AttributeError 'do_not_compile' in its first forward before), one built after is plain
transformers, and vLLM still generates the checkpoint's log-probs, before and after a weight sync.
"""
import os

import torch

from tests.distributed import run_distributed
from tests.workers.rollout.common import make_prompts, reference_log_probs

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PROMPT_LEN, RESPONSE_LEN = 12, 8


def make_olmo2(path: str, seed: int) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridflow.tiny import BOS, EOS, PAD, char_vocab, save_char_tokenizer

    ids = char_vocab()
    cfg = AutoConfig.for_model("olmo2", vocab_size=len(ids), hidden_size=128, intermediate_size=256,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=128, pad_token_id=ids[PAD], bos_token_id=ids[BOS],
                               eos_token_id=ids[EOS])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    save_char_tokenizer(path)
    return path


def _rank(rank, world, old_path, new_path):
    from transformers import AutoModelForCausalLM
    from transformers.models.olmo2.modeling_olmo2 import Olmo2Model
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    from workers.rollout.base import RolloutConfig
    from workers.rollout.vllm_rollout import VLLMRollout

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    training = load(old_path)  # the engine's model: built before the rollout, as in the hybrid worker
    probe = torch.arange(3, 13).unsqueeze(0)
    with torch.no_grad():
        before = training(probe).logits
    rollout = VLLMRollout(RolloutConfig(prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN, seed=0,
                                        kv_cache_gib=0.25), old_path)
    out = {"decorated": TorchCompileWithNoGuardsWrapper in Olmo2Model.__mro__}
    with torch.no_grad():
        out["training_model_diff"] = float((training(probe).logits - before).abs().max())
        out["model_built_after_diff"] = float((load(old_path)(probe).logits - before).abs().max())
    prompts = make_prompts(old_path, prompt_len=PROMPT_LEN, meta={"n": 2})
    gen = rollout.generate_sequences(prompts)
    out["old_diff"] = float((gen.batch["rollout_log_probs"] - reference_log_probs(training, gen)).abs().max())
    new = load(new_path)
    rollout.update_weights((n, t.detach().clone()) for n, t in new.state_dict().items())
    gen = rollout.generate_sequences(make_prompts(old_path, prompt_len=PROMPT_LEN, meta={"n": 2}))
    out["new_diff"] = float((gen.batch["rollout_log_probs"] - reference_log_probs(new, gen)).abs().max())
    out["responses"] = int(gen.batch["response_mask"].sum())
    return out


def test_training_model_and_vllm_share_a_transformers_class(tmp_path):
    old = make_olmo2(str(tmp_path / "olmo2-0"), seed=0)
    new = make_olmo2(str(tmp_path / "olmo2-1"), seed=1)
    (out,) = run_distributed(_rank, 1, old, new)
    assert not out["decorated"], "vLLM's compile decoration was left on transformers' class"
    assert out["training_model_diff"] == 0.0 and out["model_built_after_diff"] == 0.0
    assert out["responses"] > 0
    assert out["old_diff"] < 1e-4, out  # vLLM's log-probs are the checkpoint's
    assert out["new_diff"] < 1e-4, out  # and the synced weights' after update_weights
