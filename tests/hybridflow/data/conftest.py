import pytest

from hybridflow.tiny import make_char_tokenizer


@pytest.fixture(scope="session")
def char_tokenizer():
    return make_char_tokenizer()
