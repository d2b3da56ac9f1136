"""The embedded char tokenizer: one id per character, every character round-trips."""
from hybridflow.tiny import CHARS, char_vocab, make_char_tokenizer


def test_every_character_is_its_own_token_newline_runs_included():
    tok = make_char_tokenizer()
    text = "1+2\n\n3 x\n\n\n" + CHARS
    ids = tok.encode(text, add_special_tokens=False)
    vocab = char_vocab()
    assert ids == [vocab[c] for c in text]  # "\n\n" was one unknown piece when split on "."
    assert tok.decode(ids) == text
