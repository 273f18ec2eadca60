"""split_args: how a magic's argument line is cut into tokens (brackets and quotes kept); and the
parsers take options only as written, naming the closest to an unknown one."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from monarch_kernel.kernel.args import mesh_parser, remote_parser
from monarch_kernel.kernel.magics import split_args

pytestmark = pytest.mark.unit


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


# -- %mesh NAME: what the name may replace, and --force --------------------------------
def test_mesh_parser_force_flag():
    from monarch_kernel.kernel.args import mesh_parser

    assert mesh_parser().parse_args(["m", "--gpus", "2"]).force is False
    assert mesh_parser().parse_args(["m", "--gpus", "2", "--force"]).force is True


def _magics(user_ns=None, hidden=()):
    from types import SimpleNamespace

    from monarch_kernel.kernel.magics import MeshMagics

    shell = SimpleNamespace(
        user_ns=dict(user_ns or {}), user_ns_hidden=dict.fromkeys(hidden), displayhook=None
    )
    return MeshMagics(shell)


@pytest.mark.parametrize(
    "name",
    ["get_ipython", "In", "Out", "exit", "quit", "display", "open", "_", "__", "___"]
    + ["_i", "_ii", "_iii", "_i7", "_7", "_ih", "_oh", "_dh", "__name__", "_hidden_by_shell"],
)
def test_ipython_names_are_refused_even_with_force(name):
    magics = _magics(hidden=["_hidden_by_shell"])
    for force in (False, True):
        with pytest.raises(UsageError, match="is one of IPython's own names"):
            magics._check_name(name, force)


@pytest.mark.parametrize("name", ["m", "_private", "__x", "_i7x", "trainers", "ih"])
def test_free_names_are_taken(name):
    _magics()._check_name(name, False)


def test_user_variables_and_builtins_need_force():
    import numpy

    magics = _magics({"model": [1], "cfg": None, "np": numpy, "n": 3})
    for name, holds in [("model", "a list"), ("cfg", "None"), ("np", "the module numpy")]:
        with pytest.raises(UsageError) as err:
            magics._check_name(name, False)
        assert str(err.value) == (
            f"%mesh {name}: {name!r} already holds {holds} in the notebook; pick another "
            "mesh name, or add --force to replace it"
        )
        magics._check_name(name, True)
    with pytest.raises(UsageError, match="'n' already holds an int"):
        magics._check_name("n", False)
    with pytest.raises(UsageError, match="'len' is a Python builtin"):
        magics._check_name("len", False)
    magics._check_name("len", True)


def test_a_name_holding_a_mesh_is_fine():
    from types import SimpleNamespace

    from monarch_kernel.actor import ProcMesh
    from monarch_kernel.shape import Shape

    runtime = SimpleNamespace(shape=Shape.from_extent({"gpus": 2}))  # only its shape is read
    mesh = ProcMesh(runtime)
    _magics({"m": mesh})._check_name("m", False)  # re-created, or "already running"


# -- cell labels ---------------------------------------------------------------------
def _running_cell(count, store_history=True):
    from types import SimpleNamespace

    info = SimpleNamespace(store_history=store_history)
    return SimpleNamespace(exec_result=SimpleNamespace(execution_count=count, info=info))


def test_cell_labels_follow_the_prompt_number():
    magics = _magics()
    assert magics._next_cell() == "#1"  # outside a cell
    magics.shell.execution_count = 8  # IPython 9: already the *next* prompt's number
    magics.shell.displayhook = _running_cell(7)
    assert [magics._next_cell() for _ in range(3)] == ["7", "7.2", "7.3"]
    magics.shell.displayhook = _running_cell(8)
    assert magics._next_cell() == "8"
    magics.shell.displayhook = _running_cell(9, store_history=False)  # silent: no number
    assert magics._next_cell() == "#6"


@pytest.mark.parametrize(
    "parser, args, said",
    [
        (mesh_parser, ["t", "--gpu", "3"], "unknown option --gpu (did you mean --gpus?)"),
        (remote_parser, ["t", "--rank", "0"], "unknown option --rank (did you mean --ranks?)"),
        (mesh_parser, ["t", "--dis"], "unknown option --dis (did you mean --dist?)"),
        (mesh_parser, ["t", "--frobnicate"], "unknown option --frobnicate. Usage"),
        (remote_parser, ["t", "--group", "rank"], "(did you mean --group-outputs?)"),
    ],
)
def test_options_are_exact_and_a_typo_gets_the_closest_one(parser, args, said):
    # argparse would read --gpu as --gpus (a prefix): a typo must never be taken silently
    with pytest.raises(UsageError) as err:
        parser().parse_args(args)
    assert said in str(err.value), str(err.value)
