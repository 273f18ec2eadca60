"""``rank.pg.malloc``: the mmap threshold the process-group path pins, observed in glibc
itself (whether a block came from its own mapping), in fresh interpreters."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.local,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt"),
]

# Allocates with glibc's malloc and reads each block's IS_MMAPPED bit (bit 1 of the
# size word just before the block). First a 4 MiB block is freed: glibc's own rule then
# raises the threshold to 4 MiB, and a pin set afterwards must override that.
PROBE = """
import ctypes, json, os, sys
from monarch_kernel.rank.pg import malloc
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)

def mapped(size):
    p = libc.malloc(size)
    bit = bool(ctypes.c_size_t.from_address(p - 8).value & 2)
    libc.free(p)
    return bit

libc.free(libc.malloc(4 << 20))
os.environ.update(json.loads(sys.argv[1]))  # as a rank's %mesh --env sets it, after start
pinned = malloc.pin_mmap_threshold() if sys.argv[2] == "pin" else None
print(json.dumps({"pinned": pinned, "256K": mapped(256 << 10), "2M": mapped(2 << 20)}))
"""


def _probe(env: dict[str, str], pin: bool = True) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(env), "pin" if pin else "no"],
        capture_output=True, text=True, timeout=60, env=clean,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_glibc_alone_serves_a_block_below_a_freed_one_from_the_heap():
    # the dynamic rise the pin is there to stop
    assert _probe({}, pin=False) == {"pinned": None, "256K": False, "2M": False}


def test_the_pin_maps_every_block_from_128_kib_again():
    assert _probe({}) == {"pinned": True, "256K": True, "2M": True}


def test_a_users_threshold_set_after_start_is_the_one_pinned():
    # a rank is forked from a template: glibc never read the variable %mesh --env set
    got = _probe({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    assert got == {"pinned": True, "256K": False, "2M": True}


@pytest.mark.parametrize(
    "env", [{"MALLOC_TRIM_THRESHOLD_": "1000000"}, {"MALLOC_MMAP_THRESHOLD_": "1M"}]
)
def test_other_user_choices_leave_glibc_alone(env):
    assert _probe(env) == {"pinned": False, "256K": False, "2M": False}
