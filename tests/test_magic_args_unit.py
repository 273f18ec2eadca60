"""split_args: how a magic's argument line is cut into tokens (brackets and quotes kept)."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from monarch_kernel.kernel.magics import split_args


@pytest.mark.parametrize(
    "line,tokens",
    [
        ("", []),
        ("   ", []),
        ("m", ["m"]),
        ("m --ranks 0:2 --bg", ["m", "--ranks", "0:2", "--bg"]),
        # whitespace of any kind and amount separates tokens, and is dropped at the ends
        ("  m \t --ranks\n1,3  ", ["m", "--ranks", "1,3"]),
    ],
)
def test_whitespace_separates_tokens(line, tokens):
    assert split_args(line) == tokens


@pytest.mark.parametrize(
    "line,tokens",
    [
        ("a=[1, 2] b", ["a=[1, 2]", "b"]),
        ("m.slice(gpus=0) --bg", ["m.slice(gpus=0)", "--bg"]),
        ("cfg={'lr': 0.1, 'wd': 0} x", ["cfg={'lr': 0.1, 'wd': 0}", "x"]),
        # nested brackets of every kind: the token ends only when all are closed
        ("m.slice(gpus=slice(0, 2)) --ranks 1", ["m.slice(gpus=slice(0, 2))", "--ranks", "1"]),
        ("x={'a': (1, [2, 3])}   y", ["x={'a': (1, [2, 3])}", "y"]),
        # whitespace inside brackets is kept as it was
        ("f(1,\t 2)", ["f(1,\t 2)"]),
        ("a[ 0 ]b c", ["a[ 0 ]b", "c"]),
    ],
)
def test_brackets_keep_their_contents_in_one_token(line, tokens):
    assert split_args(line) == tokens


@pytest.mark.parametrize(
    "line,tokens",
    [
        ("name='a b' c", ["name='a b'", "c"]),  # quotes are kept in the token
        ('msg="x  y"', ['msg="x  y"']),
        ('s="it\'s" t', ['s="it\'s"', "t"]),  # the other quote kind inside is plain text
        ("x='(' y", ["x='('", "y"]),  # brackets inside quotes do not count
        ("f(')') z", ["f(')')", "z"]),  # nor quoted closing brackets inside brackets
        ("'a b''c d'", ["'a b''c d'"]),
    ],
)
def test_quotes_keep_their_contents_in_one_token(line, tokens):
    assert split_args(line) == tokens


@pytest.mark.parametrize(
    "line",
    [
        "f(1, 2",
        "a=[1, [2]",
        "{",
        "x='abc",
        'y="',
        "m --ranks 0:2 'oops",
        "a]",
        "[[1]] ]",
        "(]",
        "f(a[1)]",
    ],
)
def test_unbalanced_input_is_a_usage_error(line):
    with pytest.raises(UsageError) as err:
        split_args(line)
    assert str(err.value) == f"unbalanced quotes or brackets in {line!r}"


def test_closing_bracket_first_is_unbalanced():
    with pytest.raises(UsageError):
        split_args("a) (b")
