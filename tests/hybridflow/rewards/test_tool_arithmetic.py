"""The tool demo's reward: the number of the last assistant turn, once the model says it itself."""
import pytest

from hybridflow.rewards.registry import default_compute_score

CALL = '<tool_call>{"name":"calc","arguments":{"expression":"865*673+560"}}</tool_call>'
TOOL = "tool\n<tool_response>582705</tool_response>"


@pytest.mark.parametrize("text,score", [
    (f"{CALL}{TOOL}assistant\n582705", 1.0),  # decoded without the special tokens
    (f"{CALL}<|im_end|><|im_start|>{TOOL}<|im_end|><|im_start|>assistant\n582705<|im_end|>", 1.0),  # with them
    ("582705", 1.0),  # a direct answer
    (f"{CALL}{TOOL}assistant\n582706", 0.0),
    (f"{CALL}{TOOL}", 0.0),  # cut before the answer: the tool's number is not the model's
    (f"{CALL}{TOOL}assistant\n{CALL}", 0.0),  # the last turn is another call
    ('<tool_call>{"name":"calc","arguments":{"expression":"582705"}}</tool_call>', 0.0),
    (f"{CALL}{TOOL}assistant\nit is 5 and then 582705", 1.0),  # the last number
])
def test_scores_the_last_assistant_turns_number(text, score):
    assert default_compute_score("tool_arithmetic", text, "582705") == score


def test_a_bad_ground_truth_raises():
    with pytest.raises(ValueError):
        default_compute_score("tool_arithmetic", "5", "five")
