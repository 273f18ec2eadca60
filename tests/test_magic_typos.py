"""A misspelt option is an error naming the closest one, in every magic that takes options
(argparse would read ``--gpu`` as ``--gpus`` and ``--rank`` as ``--ranks``); nothing is
started or changed by a refused line."""

from __future__ import annotations

import pytest
from kernel_client import Kernel

pytestmark = pytest.mark.local


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    yield k
    k.shutdown_and_check()


def test_a_typo_in_mesh_starts_nothing(kernel):
    r = kernel.run("%mesh ty --gpu 2")
    said = r.stderr + r.error_text  # IPython shows a UsageError on stderr
    assert "unknown option --gpu (did you mean --gpus?)" in said, said
    r = kernel.run("%mesh")  # the list of meshes
    assert "ty" not in r.stdout, r.stdout


@pytest.mark.parametrize(
    "line, said",
    [
        ("%%remote ty --rank 0\n1", "unknown option --rank (did you mean --ranks?)"),
        ("%mesh grow ty --rank +1", "unknown option --rank (did you mean --ranks?)"),
        ("%mesh shrink ty --drop-rank 1", "--drop-rank (did you mean --drop-ranks?)"),
        ("%mesh stop ty --forc", "unknown option --forc (did you mean --force?)"),
        ("%debug_remote ty --clr", "unknown option --clr (did you mean --clear?)"),
    ],
)
def test_every_magic_names_the_closest_option(kernel, line, said):
    r = kernel.run("%mesh ty --gpus 2", timeout=120)
    assert not r.errors, r.error_text
    pids = kernel.run("%remote ty __import__('os').getpid()").text
    r = kernel.run(line)
    assert said in r.stderr + r.error_text, r.stderr + r.error_text
    assert kernel.run("%remote ty __import__('os').getpid()").text == pids  # untouched
