"""``actor_rollout_ref.rollout.speculative`` (hybridflow/config/speculative.py): off by default;
what it cannot run on is refused before any worker starts, in one line naming the key and the fix;
the settings reach the rollout workers and vLLM's speculative_config."""
import pytest

from hybridflow.config import load_config, validate
from recipes.engine_settings import rollout_engine_kwargs
from tests.hybridflow.config.validate_helpers import error_of, grpo
from workers.rollout.vllm_speculative import HISTORY_DRAFTER, speculative_kwargs

SPEC = "actor_rollout_ref__rollout__speculative__"


def test_off_by_default_with_adaptive_history_drafts_when_on():
    spec = load_config({}).actor_rollout_ref.rollout.speculative
    assert (spec.enable, spec.method, spec.adaptive, spec.num_speculative_tokens) == (False, "history", True, 4)


def test_needs_vllm():
    validate(grpo(**{SPEC + "enable": True}), check_paths=False)
    msg = error_of(grpo(**{SPEC + "enable": True, "actor_rollout_ref__rollout__name": "hf"}), check_paths=False)
    assert "speculative.enable=true" in msg and "rollout.name=vllm" in msg, msg


def test_draft_model_needs_a_checkpoint_folder(tmp_path):
    msg = error_of(grpo(**{SPEC + "enable": True, SPEC + "method": "draft_model"}), check_paths=False)
    assert "set actor_rollout_ref.rollout.speculative.draft_model_path" in msg, msg
    msg = error_of(grpo(**{SPEC + "enable": True, SPEC + "method": "draft_model",
                           SPEC + "draft_model_path": str(tmp_path / "missing")}), check_paths=False)
    assert "is not a folder" in msg, msg


def test_parallel_drafting_needs_a_draft_trained_for_it(tmp_path):
    """A parallel (PARD) draft reads mask tokens: a draft whose config names none was not trained
    for it, and would only propose noise after its first token."""
    plain, pard = tmp_path / "plain", tmp_path / "pard"
    for folder, extra in ((plain, ""), (pard, ', "pard_token": 99')):
        folder.mkdir()
        (folder / "config.json").write_text('{"model_type": "qwen2"' + extra + "}")
    on = {SPEC + "enable": True, SPEC + "method": "draft_model", SPEC + "parallel_drafting": True}
    msg = error_of(grpo(**on, **{SPEC + "draft_model_path": str(plain)}), check_paths=False)
    assert "parallel_drafting=true" in msg and "names no mask token" in msg and "pard_token" in msg, msg
    msg = error_of(grpo(**{**on, SPEC + "method": "ngram"}), check_paths=False)
    assert "set actor_rollout_ref.rollout.speculative.method=draft_model" in msg, msg
    cfg = grpo(**on, **{SPEC + "draft_model_path": str(pard)})
    validate(cfg, check_paths=False)
    vllm = speculative_kwargs(rollout_engine_kwargs(cfg)["speculative"], 64)
    assert (vllm["method"], vllm["model"], vllm["parallel_drafting"]) == ("draft_model", str(pard), True)


@pytest.mark.parametrize("overrides, words", [
    ({SPEC + "method": "medusa"}, "speculative.method"),
    ({SPEC + "num_speculative_tokens": 0}, "[1, 16]"),
    ({SPEC + "prompt_lookup_min": 5}, "must be <= prompt_lookup_max"),
])
def test_bad_values_name_the_key(overrides, words):
    msg = error_of(grpo(**{SPEC + "enable": True, **overrides}), check_paths=False)
    assert words in msg, msg


def test_settings_reach_vllm():
    cfg = grpo(**{SPEC + "enable": True, SPEC + "num_speculative_tokens": 3,
                  "actor_rollout_ref__rollout__max_num_seqs": 64})
    spec = rollout_engine_kwargs(cfg)["speculative"]
    vllm = speculative_kwargs(spec, 64)
    # the dynamic table is always set: the scheduler then leaves the per-step count to it
    assert vllm == dict(method="custom_class", model=HISTORY_DRAFTER, num_speculative_tokens=3,
                        num_speculative_tokens_per_batch_size=[(1, 64, 3)])
    ngram = speculative_kwargs(dict(spec, method="ngram"), 64)
    assert (ngram["method"], ngram["prompt_lookup_min"], ngram["prompt_lookup_max"]) == ("ngram", 2, 4)
    assert speculative_kwargs(dict(spec, enable=False), 64) is None


def test_vllms_own_speculative_config_is_refused_for_the_keys():
    msg = error_of(grpo(**{"actor_rollout_ref__rollout__engine_kwargs__vllm": {"speculative_config": {"method": "ngram"}}}),
                   check_paths=False)
    assert "speculative_config is set by hybridflow from actor_rollout_ref.rollout.speculative" in msg, msg
