"""hybridflow/agent/tool_calls.py: Hermes <tool_call> blocks; malformed blocks counted, never raised."""
from hybridflow.agent.tool_calls import FunctionCall, parse_tool_calls


def test_calls_are_parsed_in_order_and_the_text_outside_them_is_the_content():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"q": "x", "k": 2}}</tool_call></s>')
    parsed = parse_tool_calls(text)
    assert parsed.calls == [FunctionCall("calculator", {"expression": "2+3"}), FunctionCall("search", {"q": "x", "k": 2})]
    assert parsed.failures == 0
    assert parsed.content == "Let me compute.\n</s>"


def test_plain_text_has_no_calls_and_no_failures():
    parsed = parse_tool_calls("The answer is 5.")
    assert (parsed.calls, parsed.failures, parsed.content) == ([], 0, "The answer is 5.")


def test_arguments_given_as_a_json_string_are_decoded():
    parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert parsed.calls == [FunctionCall("f", {"a": 1})] and parsed.failures == 0


def test_malformed_blocks_are_counted_and_good_ones_kept():
    text = ("<tool_call>{not json}</tool_call>"                      # bad JSON
            '<tool_call>{"arguments": {}}</tool_call>'                # no name
            '<tool_call>{"name": "f"}</tool_call>'                    # no arguments
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'  # arguments not an object
            '<tool_call>["f", {}]</tool_call>'                        # not an object at all
            '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "cut", "argu')                       # opened, never closed
    parsed = parse_tool_calls(text)
    assert parsed.calls == [FunctionCall("ok", {})]
    assert parsed.failures == 6
    assert parsed.content == ""
