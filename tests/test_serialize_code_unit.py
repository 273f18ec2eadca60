"""Functions and classes that pickle by value keep the file they were defined in, so a
rank's traceback, ``%mesh stacks`` and a breakpoint find their source lines: whatever
cloudpickle does with ``co_filename`` (3.1.3 replaced it with ``<dynamic-code>``)."""

from __future__ import annotations

import pickle
import traceback

import pytest

from monarch_kernel.wire import serialize as S

pytestmark = pytest.mark.unit


def _round_trip(value):
    payload, buffers = S.dumps(value)
    return S.loads(payload, [memoryview(b.raw()) for b in buffers])


def _local_function():
    """Local, so cloudpickle pickles it by value (it cannot be imported by name)."""

    def fails(x):
        def inner():
            raise ValueError(f"bad {x}")  # the line a traceback must show

        return inner

    return fails


def _local_class():
    class Scaler:
        def scale(self, v):
            return v * 3  # a method's line

    return Scaler


def test_a_function_by_value_keeps_its_file_and_its_inner_functions_do_too():
    fails = _round_trip(_local_function())
    assert fails.__code__.co_filename == __file__
    inner = fails(4)
    assert inner.__code__.co_filename == __file__
    with pytest.raises(ValueError, match="bad 4") as err:
        inner()
    text = "".join(traceback.format_exception(err.value))
    assert f'File "{__file__}"' in text
    assert 'raise ValueError(f"bad {x}")  # the line a traceback must show' in text


def test_a_class_by_value_keeps_its_methods_files():
    Scaler = _round_trip(_local_class())
    assert Scaler.scale.__code__.co_filename == __file__
    assert Scaler().scale(2) == 6


def test_the_same_code_twice_in_one_value_loads_and_runs():
    fails = _local_function()
    a, b = _round_trip((fails, fails))
    assert a is b and a(1).__code__.co_filename == __file__


def test_what_plain_pickle_of_the_payload_sees_is_the_loaded_code():
    # the payload is an ordinary pickle: a receiver without our module's help (plain
    # pickle.loads, as Ray's or a peer's tooling would do) gets the same function
    payload, buffers = S.dumps(_local_function())
    fails = pickle.loads(payload, buffers=[b.raw() for b in buffers])
    assert fails.__code__.co_filename == __file__
