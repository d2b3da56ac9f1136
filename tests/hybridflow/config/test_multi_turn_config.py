"""``actor_rollout_ref.rollout.multi_turn`` and ``.agent`` (hybridflow/config/multi_turn.py): verl's keys
and defaults, what multi-turn rollouts cannot run with refused in one line each before any worker
starts (the tool config checked by its loader), and the settings reaching the rollout workers."""
import pytest

from hybridflow.config import load_config, validate
from recipes.cli import compose_config
from recipes.engine_settings import rollout_engine_kwargs
from tests.hybridflow.config.validate_helpers import error_of, grpo

MT = "actor_rollout_ref__rollout__multi_turn__"
ON = {MT + "enable": True}


def test_verls_defaults_and_its_keys_load_from_the_command_line():
    r = load_config({}).actor_rollout_ref.rollout
    mt = r.multi_turn
    assert (mt.enable, mt.max_assistant_turns, mt.max_user_turns, mt.max_parallel_calls, mt.max_tool_response_length,
            mt.tool_response_truncate_side, mt.tool_config_path, mt.format) == (
        False, None, None, 1, 256, "middle", None, "hermes")
    assert r.agent.default_agent_loop == "single_turn_agent"
    arr = "actor_rollout_ref.rollout"
    cfg = load_config(compose_config("grpo", [f"{arr}.multi_turn.enable=true", f"{arr}.multi_turn.max_assistant_turns=3",
                                              f"{arr}.agent.default_agent_loop=tool_agent", f"{arr}.agent.num_workers=8",
                                              f"{arr}.multi_turn.tokenization_sanity_check_mode=strict"]))
    assert cfg.actor_rollout_ref.rollout.multi_turn.max_assistant_turns == 3


def test_on_with_the_defaults_is_valid():
    validate(grpo(**ON), check_paths=False)


@pytest.mark.parametrize("overrides, words", [
    ({"actor_rollout_ref__rollout__name": "hf"}, "set actor_rollout_ref.rollout.name=vllm"),
    ({"actor_rollout_ref__hybrid_engine": False}, "set hybrid_engine=true"),
    ({"stage_fusion__enable": True}, "stage_fusion.enable=true"),
    ({"actor_rollout_ref__rollout__reallocation__enable": True}, "reallocation.enable=true"),
    ({"actor_rollout_ref__rollout__speculative__enable": True}, "speculative.enable=true"),
    ({"actor_rollout_ref__rollout__agent__default_agent_loop": "react"}, "default_agent_loop='react' is unknown"),
    ({"actor_rollout_ref__rollout__agent__default_agent_loop": "no_such.Loop"}, "does not load"),
    ({MT + "tool_response_truncate_side": "both"}, "tool_response_truncate_side"),
    ({MT + "max_parallel_calls": 0}, "max_parallel_calls"),
])
def test_what_it_cannot_run_with_is_refused_in_one_line(overrides, words):
    msg = error_of(grpo(**ON, **overrides), check_paths=False)
    assert words in msg and "\n" not in msg, msg


def test_the_tool_config_is_checked_by_its_loader(tmp_path):
    missing = error_of(grpo(**ON, **{MT + "tool_config_path": str(tmp_path / "none.yaml")}), check_paths=False)
    assert "tool_config_path" in missing and "is not a file" in missing, missing
    bad = tmp_path / "tools.yaml"
    bad.write_text("tools:\n  - class_name: no.such.Tool\n    tool_schema: {type: function, function: {name: x}}\n")
    msg = error_of(grpo(**ON, **{MT + "tool_config_path": str(bad)}), check_paths=False)
    assert "multi_turn.tool_config_path" in msg and "no.such.Tool" in msg, msg


def test_settings_reach_the_rollout_with_the_tokenizer_and_default_loop():
    assert rollout_engine_kwargs(grpo())["multi_turn"] == {}
    mt = rollout_engine_kwargs(grpo(**ON, **{MT + "max_user_turns": 2,
                                             "actor_rollout_ref__rollout__agent__default_agent_loop": "tool_agent"}))["multi_turn"]
    cfg = grpo()
    assert mt["enable"] and mt["max_user_turns"] == 2 and mt["default_agent_loop"] == "tool_agent"
    assert mt["tokenizer_path"] == cfg.actor_rollout_ref.model.path and mt["apply_chat_template_kwargs"] == {}
