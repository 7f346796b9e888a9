"""Stop strings (frontend.tokenizer.StopStringMatcher): cut across deltas, held back only while a
stop could still complete, released by flush, and equal to cutting the unsplit text."""

from __future__ import annotations

import random

import pytest

from backend.types.errors import InvalidRequestError
from frontend.tokenizer import StopStringMatcher


def feed(matcher, deltas) -> list[str]:
    return [matcher.push(delta) for delta in deltas]


def test_stop_string_spanning_several_deltas_is_cut():
    matcher = StopStringMatcher(["STOP"])
    assert feed(matcher, ["abc S", "T", "O", "P and more"]) == ["abc ", "", "", ""]
    assert matcher.stop_string == "STOP"
    assert matcher.push("anything") == "" and matcher.flush() == ""


def test_include_stop_str_in_output_releases_at_once_and_keeps_the_stop():
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert feed(matcher, ["abc S", "T", "OP and more"]) == ["abc S", "T", "OP"]
    assert matcher.stop_string == "STOP"


def test_stop_string_at_the_very_beginning():
    matcher = StopStringMatcher(["<end>"])
    assert feed(matcher, ["<e", "nd> tail"]) == ["", ""]
    assert matcher.stop_string == "<end>"


def test_unfinished_stop_string_is_released_by_flush():
    matcher = StopStringMatcher(["STOP"])
    assert feed(matcher, ["ab", " ST", "O"]) == ["ab", " ", ""]
    assert matcher.flush() == "STO"
    assert matcher.stop_string is None


def test_only_a_possible_stop_prefix_is_held_back():
    matcher = StopStringMatcher(["abc", "xyz12"])
    assert matcher.push("0123456789") == "0123456789"  # no tail starts a stop string
    assert matcher.push("--xyz1") == "--"  # held: "xyz1", less than the longest stop
    assert matcher.push("a") == "xyz1"  # "xyz1a" is no stop; "a" may start "abc"
    assert matcher.flush() == "a"


def test_first_completed_stop_string_wins():
    assert feed(StopStringMatcher(["abcd", "c"]), ["xabcd"]) == ["xab"]
    matcher = StopStringMatcher(["bar", "foo"], include_stop_str_in_output=True)
    assert feed(matcher, ["a foo bar"]) == ["a foo"] and matcher.stop_string == "foo"


def test_stop_strings_before_can_stop_are_ignored():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("a STOP b", can_stop=False) == "a STOP b"
    assert matcher.push("ST", can_stop=False) == ""
    assert matcher.push("OP", can_stop=True) == ""  # completed once stopping is allowed
    assert matcher.stop_string == "STOP"


def test_stop_matcher_matches_the_unsplit_reference():
    rng = random.Random(7)
    alphabet = "abcST "
    stops = ["ST", "abca", "cab"]
    for include in (False, True):
        for _ in range(300):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
            ends = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
            if ends:
                end, neg_len, stop = min(ends)
                expected = text[:end] if include else text[:end + neg_len]
            else:
                stop, expected = None, text
            matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
            deltas = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
            released = feed(matcher, deltas)
            held = max(len(s) for s in stops) - 1
            assert all(len("".join(released[:k + 1])) >= len("".join(deltas[:k + 1])) - held
                       for k in range(len(deltas)) if matcher.stop_string is None)
            out = "".join(released) + matcher.flush()
            assert (out, matcher.stop_string) == (expected, stop), (text, deltas)


def test_stop_matcher_rejects_empty_stop_strings():
    with pytest.raises(InvalidRequestError):
        StopStringMatcher(["ok", ""])
    assert StopStringMatcher([]).push("anything") == "anything"
