"""override_config reaches the HF config where transformers reads it (rope keys included), leaves
the checkpoint's config alone, and survives a save; external_lib is imported (or named when not)."""
import sys

import pytest

from hybridflow.model_overrides import apply_overrides, external_lib_error, load_hf_config, overridden_dict


@pytest.fixture
def config():
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)


def test_plain_and_rope_keys_land_where_the_model_reads_them(config):
    out = apply_overrides(config, {"rms_norm_eps": 0.3, "rope_theta": 50.0, "attention_dropout": 0.1})
    assert (out.rms_norm_eps, out.rope_parameters["rope_theta"], out.attention_dropout) == (0.3, 50.0, 0.1)
    assert (config.rms_norm_eps, config.rope_parameters["rope_theta"]) == (1e-6, 10000.0)  # a copy


def test_rope_scaling_updates_the_rope_parameters_key_by_key(config):
    # verl's legacy "type" names the rope type; the checkpoint's rope_theta stays (vLLM's dict
    # form of hf_overrides replaces the whole mapping and loses it)
    linear = apply_overrides(config, {"rope_scaling": {"type": "linear", "factor": 2.0}}).rope_parameters
    assert (linear["rope_type"], linear["factor"], linear["rope_theta"]) == ("linear", 2.0, 10000.0)
    # yarn scales from the length the weights were trained at, not the raised maximum
    yarn = apply_overrides(config, {"max_position_embeddings": 2048,
                                    "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert (yarn.max_position_embeddings, yarn.rope_parameters["original_max_position_embeddings"]) == (2048, 512)


def test_a_saved_overridden_config_loads_back_overridden(config, tmp_path):
    apply_overrides(config, {"rope_theta": 50.0, "rms_norm_eps": 0.3}).save_pretrained(tmp_path)
    loaded = load_hf_config(str(tmp_path))
    assert (loaded.rope_parameters["rope_theta"], loaded.rms_norm_eps) == (50.0, 0.3)
    assert load_hf_config(str(tmp_path), {"rms_norm_eps": 0.1}).rms_norm_eps == 0.1


def test_size_checks_see_overrides_but_never_shape_keys():
    hf = {"max_position_embeddings": 512, "hidden_size": 64}
    assert overridden_dict(hf, {"max_position_embeddings": 1024, "hidden_size": 8}) == {
        "max_position_embeddings": 1024, "hidden_size": 64}
    # the checks read the rope type the model will use: a legacy "type" replaces the kept rope_type
    scaled = overridden_dict({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                             {"rope_scaling": {"type": "linear", "factor": 2.0}})
    assert scaled["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


def test_external_lib_is_imported_or_named(tmp_path, monkeypatch):
    (tmp_path / "hf_test_marker_lib.py").write_text("IMPORTED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert external_lib_error("k", "hf_test_marker_lib") is None
        assert sys.modules["hf_test_marker_lib"].IMPORTED
    finally:
        sys.modules.pop("hf_test_marker_lib", None)
    (tmp_path / "hf_test_broken_lib.py").write_text("raise RuntimeError('needs a GPU\\nsecond line')\n")
    assert external_lib_error("k", "hf_test_broken_lib") == (
        "k='hf_test_broken_lib' cannot be imported (RuntimeError: needs a GPU): install it or put its folder on "
        "PYTHONPATH")
    assert external_lib_error("k", None) is None


def test_attn_implementation_is_a_load_option_not_a_config_attribute(config):
    from hybridflow.model_overrides import load_options, override_errors

    hf = config.to_dict()
    # verl's key: accepted by the config check, handed to from_pretrained, kept off the config
    # (vLLM builds its model from apply_overrides' config and has attention kernels of its own)
    assert override_errors("k", hf, {"attn_implementation": "eager", "rms_norm_eps": 0.3}) == []
    assert load_options({"attn_implementation": "eager", "rms_norm_eps": 0.3}) == {"attn_implementation": "eager"}
    out = apply_overrides(config, {"attn_implementation": "eager", "rms_norm_eps": 0.3})
    assert out.rms_norm_eps == 0.3 and "attn_implementation" not in vars(out)
    assert "attn_implementation" not in overridden_dict(hf, {"attn_implementation": "eager"})
    [error] = override_errors("k", hf, {"attn_implementation": "flash"})
    assert error.startswith("k.attn_implementation='flash' is not an attention transformers knows")
    assert "'eager'" in error and "'sdpa'" in error
