import pytest

from hybridflow.rewards import RULE_SCORERS, default_compute_score, get_rule_scorer
from hybridflow.rewards import arithmetic, count, gsm8k


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("12 + 30 = 42", 42, 1.0),
        ("12 + 30 = 42<|im_end|>", "42", 1.0),
        ("Let me compute: 7 * 6 = 40 + 2 = 42.", "42", 1.0),  # the LAST '=' counts
        ("7 * 6 = 41", 42, 0.0),
        ("The answer is 42", 42, 1.0),  # no '=': last integer
        ("3 - 10 = -7", "-7", 1.0),
        ("x = ?? I think 9", 9, 1.0),  # nothing after '=', falls back to the last integer
        ("I don't know", 5, 0.0),
        ("5 = 5.0", "5.0", 1.0),  # ground truth "5.0" is the integer 5
    ],
)
def test_arithmetic(response, truth, expected):
    assert arithmetic.compute_score(response, truth) == expected


def test_arithmetic_bad_ground_truth_raises():
    with pytest.raises(ValueError, match="ground_truth must be a whole number"):
        arithmetic.compute_score("= 3", "3.5")
    with pytest.raises(ValueError, match="must be an integer"):
        arithmetic.compute_score("= 3", "three")
    # also when the response holds no answer: a bad data set fails on every sample, not on some
    with pytest.raises(ValueError, match="must be an integer"):
        arithmetic.compute_score("no idea", "abc")
    with pytest.raises(ValueError, match="gsm8k ground_truth must be a number"):
        gsm8k.compute_score("no idea", "abc")


@pytest.mark.parametrize(
    "response, expected",
    [
        ("137 138 139 140", 1.0),
        ("137 138 139 140</s>", 1.0),  # EOS text and whitespace after the answer are ignored
        ("  137 138 139 140 <|im_end|>\n", 1.0),
        ("137 138", 0.5),  # stopped early: the fraction of the answer's numbers right
        ("137 138 139", 0.75),
        ("137 999 139 140", 0.25),  # the credit ends at the first wrong number
        ("137 138 139 140 141", 0.8),  # writing past the end costs like a wrong number
        ("137 138 139 140 done", 0.8),  # so does other trailing text
        ("137 138abc", 0.5),
        ("1371 138", 0.0),  # "1371" is one number, not 137
        ("138 139 140", 0.0),  # right numbers, wrong start
        ("count 137 to 140: 137 138 139 140", 0.0),  # the answer must come first
        ("I don't know", 0.0),
        ("", 0.0),
    ],
)
def test_count_partial_credit_for_the_correct_leading_run(response, expected):
    assert count.compute_score(response, "137 138 139 140") == pytest.approx(expected)


def test_count_bad_ground_truth_raises_even_without_an_answer():
    with pytest.raises(ValueError, match="count ground_truth must be integers"):
        count.compute_score("no idea", "1 two 3")
    with pytest.raises(ValueError, match="count ground_truth must be integers"):
        count.compute_score("1 2", "")


GSM_RESPONSE = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize(
    "response, truth, method, expected",
    [
        (GSM_RESPONSE, "72", "strict", 1.0),
        (GSM_RESPONSE.replace("#### 72", "#### 73"), "72", "strict", 0.0),
        ("She pays $1,000 in total.\n#### $1,000.", "1000", "strict", 1.0),
        ("so the total is 72.", "72", "strict", 0.0),  # strict needs '####'
        ("so the total is 72.", "72", "flexible", 1.0),
        ("first 10, then 72 and finally 18 apples", "18", "flexible", 1.0),
        ("#### 18.00", "18", "strict", 1.0),  # compared by value, unlike verl's string match
        ("#### 2 #### 3", "3", "strict", 1.0),  # the last '####'
    ],
)
def test_gsm8k(response, truth, method, expected):
    assert gsm8k.compute_score(response, truth, method=method) == expected


def test_gsm8k_format_score_and_long_prefix():
    assert gsm8k.compute_score("#### 5", "6", format_score=0.1) == 0.1
    assert gsm8k.compute_score("x" * 5000 + "#### 6", "6") == 1.0
    with pytest.raises(ValueError, match="strict' or 'flexible"):
        gsm8k.compute_score("#### 6", "6", method="loose")


def test_default_dispatch_by_data_source():
    assert default_compute_score("arithmetic", "2+2=4", "4") == 1.0
    assert default_compute_score("openai/gsm8k", GSM_RESPONSE, "72") == 1.0
    assert default_compute_score("gsm8k", GSM_RESPONSE, "72", extra_info={"split": "test"}) == 1.0
    assert default_compute_score("count", "137 138 139</s>", "137 138 139") == 1.0
    assert set(RULE_SCORERS) == {"arithmetic", "count", "gsm8k", "openai/gsm8k", "tool_arithmetic"}


def test_unknown_data_source_error_names_sources_and_fix():
    with pytest.raises(ValueError) as err:
        get_rule_scorer("math500")
    message = str(err.value)
    assert "'math500'" in message and "openai/gsm8k" in message and "custom_reward_function.path" in message
