"""Importing ``lightning_sdk`` (the lightning backend does, in the kernel) leaves the
environment that ranks inherit as it was: the SDK's own import sets ``TQDM_POSITION=-1``
and ``TQDM_MININTERVAL=1`` when stderr is no terminal, which made every later rank's
tqdm bar draw once a second, a row below the cursor. Each check runs in a fresh
interpreter (the import happens once per process) with stderr a pipe, as a kernel's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.unit,
    # not imported here: its import would change this process's environment
    pytest.mark.skipif(not importlib.util.find_spec("lightning_sdk"), reason="no lightning-sdk"),
]

NAMES = ("TQDM_POSITION", "TQDM_MININTERVAL")
SHOW = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {NAMES!r}}}))"


def environment_after(code: str, env: dict[str, str] | None = None) -> dict[str, str | None]:
    """The TQDM variables of a fresh interpreter's environment after ``code``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
    script = f"{code}\n{SHOW}"
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**clean, "LIGHTNING_DISABLE_VERSION_CHECK": "1", **(env or {})},
        capture_output=True,  # stderr a pipe: no terminal, as a kernel's
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_sdks_own_import_sets_the_tqdm_variables():
    # what the backend guards against (if a release stops doing it, this says so)
    assert environment_after("import lightning_sdk") == {
        "TQDM_POSITION": "-1",
        "TQDM_MININTERVAL": "1",
    }


def test_import_sdk_leaves_them_as_they_were():
    code = "from monarch_kernel.launchers.lightning_engine import import_sdk; import_sdk()"
    assert environment_after(code) == {"TQDM_POSITION": None, "TQDM_MININTERVAL": None}
    # a value the user set stays
    mine = {"TQDM_MININTERVAL": "0.5"}
    assert environment_after(code, mine) == {"TQDM_POSITION": None, "TQDM_MININTERVAL": "0.5"}
