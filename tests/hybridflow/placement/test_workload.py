"""Model shapes: the catalog's parameter counts are the published checkpoints' (the cost model's base)."""
import json

import pytest

from hybridflow.placement.workload import CATALOG, ModelShape, Workload, model_by_name


@pytest.mark.parametrize("name,params", [
    ("llama-2-7b", 6_738_415_616),    # meta-llama/Llama-2-7b-hf safetensors total
    ("llama-2-13b", 13_015_864_320),
    ("codellama-34b", 33_743_970_304),
    ("llama-2-70b", 68_976_648_192),
])
def test_catalog_parameter_counts_match_the_checkpoints(name, params):
    assert CATALOG[name].params == params


def test_from_hf_config_reads_llama_keys_and_defaults_kv_heads():
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
           "vocab_size": 100, "tie_word_embeddings": True, "model_type": "llama"}
    shape = ModelShape.from_hf_config(json.loads(json.dumps(cfg)))
    assert shape.kv_heads == 4 and shape.tied
    # per layer: q,o 2*64*64 + k,v 2*64*64 + mlp 3*64*128 + 2 norms; tied embedding 100*64 + final norm
    assert shape.params == 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 100 * 64 + 64


def test_aliases_and_unknown_names():
    assert model_by_name("70B") is CATALOG["llama-2-70b"]
    with pytest.raises(KeyError, match="unknown model"):
        model_by_name("71b")


def test_workload_roles_follow_the_models_given():
    s = CATALOG["llama-2-7b"]
    assert Workload(actor=s).roles == ("actor", "ref")
    assert Workload(actor=s, critic=s, reward_model=s).roles == ("actor", "ref", "critic", "reward_model")
    assert Workload(actor=s, reference=False, prompts=8, samples_per_prompt=4).sequences == 32
