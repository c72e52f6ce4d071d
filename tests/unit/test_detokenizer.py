"""Unit tests of incremental detokenization: the streamed text is the whole decode's, stop
strings are held back and cut, and a token's decode does not grow with the output."""

import random

import pytest

from backend.serving.detokenizer import IncrementalDetokenizer

TEXT = "Grüße 😀 naïve café — 東京 ok.\nThe end, and 3.14 more: «quoted» ½"


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class LeadingSpaceTokenizer:
    """SentencePiece's rule: a piece starting a decode loses its leading space."""

    PIECES = ["▁Hello", "▁wor", "ld", ",", "▁how", "▁are", "▁you", "?"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids).replace("▁", " ").removeprefix(" ")


class Counting:
    """Wraps a tokenizer; records how many ids each decode was given."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(detok, ids, sizes, final=True):
    """Feed ``ids`` in batches of the given sizes (cycled); the deltas."""
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(detok.add(ids[i : i + n], final=final and i + n >= len(ids)))
        i, k = i + n, k + 1
    return out


@pytest.mark.parametrize("sizes", [[1], [3], [1, 4, 2, 5]])
def test_streamed_text_is_the_whole_decode(tokenizer, sizes):
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode(TEXT)
    ids = ids[:9] + [special] + ids[9:]  # a special token inside: skipped, as in a whole decode
    deltas = stream(IncrementalDetokenizer(tokenizer), ids, sizes)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)  # a character split over tokens is sent whole


def test_a_leading_space_rule_does_not_eat_spaces_between_batches():
    tok = LeadingSpaceTokenizer()
    ids = list(range(len(tok.PIECES)))
    deltas = stream(IncrementalDetokenizer(tok), ids, [1])
    assert "".join(deltas) == tok.decode(ids) == "Hello world, how are you?"


def test_the_end_of_an_output_is_sent_even_when_it_is_half_a_character(tokenizer):
    ids = tokenizer.encode("ok 😀")
    cut = ids[:-1]  # the emoji's bytes are spread over tokens: this ends inside it
    assert tokenizer.decode(cut).endswith("\ufffd")
    whole = tokenizer.decode(cut, skip_special_tokens=True)
    d = IncrementalDetokenizer(tokenizer)
    first = d.add(cut)
    assert first == whole.rstrip("\ufffd") == "ok "  # the half character held back while more may come
    assert first + d.add([], final=True) == whole


def test_a_token_costs_the_same_at_the_end_of_a_long_output(tokenizer):
    ids = tokenizer.encode(TEXT * 50)
    assert len(ids) > 1500
    counting = Counting(tokenizer)
    deltas = stream(IncrementalDetokenizer(counting), ids, [1, 2, 1, 3])
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(counting.lengths) <= 8  # two batches and a character's tokens, never the output so far


def test_detokenizer_holds_back_partial_stop_word():
    d = IncrementalDetokenizer(CharTokenizer(), stop_words=["END"])
    assert d.add([ord("a"), ord("E")]) == "a"
    assert d.add([ord("N")]) == ""
    assert d.add([ord("x")]) == "ENx"
    assert d.add([ord(c) for c in "yEND"]) == "y" and d.stopped
    assert d.add([ord("z")]) == ""


@pytest.mark.parametrize("seed", range(5))
def test_stop_strings_cut_where_a_whole_search_would(tokenizer, seed):
    ids = tokenizer.encode(TEXT * 3)
    words = ["café — 東", "3.14 more", "\nThe", "zz never"]
    sizes = random.Random(seed).choices([1, 2, 3, 5], k=50)
    d = IncrementalDetokenizer(tokenizer, stop_words=words)
    text = "".join(stream(d, ids, sizes, final=False))
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert d.stopped
    assert text == whole[: min(i for i in (whole.find(w) for w in words) if i != -1)]
