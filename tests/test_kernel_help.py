"""Help in a real monarch kernel: Tab completion of mesh names and magic options,
plain-text ``%mesh?`` pages that list every option, and ``%push`` saying what it set."""

from __future__ import annotations

from typing import Any

import pytest
from kernel_client import kernel_with_mesh

pytestmark = pytest.mark.local


@pytest.fixture(scope="module")
def kernel():
    k = kernel_with_mesh("helpers", 2)
    yield k
    k.shutdown_and_check()


def _complete(kernel: Any, code: str) -> list[str]:
    msg_id = kernel.kc.complete(code, len(code))
    while True:
        reply = kernel.kc.get_shell_msg(timeout=10)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]["matches"]


def test_tab_completes_mesh_names_and_options(kernel):
    assert "helpers" in _complete(kernel, "%%remote hel")
    assert "helpers" in _complete(kernel, "%push hel")
    assert {"stop", "stacks"} <= set(_complete(kernel, "%mesh st"))
    assert "helpers" in _complete(kernel, "%mesh stop h")
    assert _complete(kernel, "%mesh big --tim") == ["--time", "--timeout"]
    assert "--dist" in _complete(kernel, "%mesh big --d")
    assert _complete(kernel, "%mesh big --backend r") == ["ray"]
    assert _complete(kernel, "%mesh big --on-failure co") == ["continue"]
    assert "--bg" in _complete(kernel, "%%remote helpers --b")
    assert "--ranks" in _complete(kernel, "%mesh restart helpers --r")


def test_magic_help_is_plain_text_with_every_option(kernel):
    r = kernel.run("%mesh?")
    pages = [p for p in r.reply.get("payload", []) if p.get("source") == "page"]
    assert pages, r.reply
    text = pages[0]["data"]["text/plain"]
    for option in ("--gpus", "--hosts", "--backend", "--dist", "--timeout", "--on-failure"):
        assert option in text, option
    assert "``" not in text and ":func:" not in text  # no reStructuredText markup
    r = kernel.run("%%remote?")
    text = next(p for p in r.reply["payload"] if p.get("source") == "page")["data"]["text/plain"]
    assert "--bg" in text and "--group-outputs" in text


def test_push_says_what_it_set(kernel):
    r = kernel.run("cfg = {'depth': 4}\n%push helpers lr=1e-4 cfg")
    assert r.stdout.strip() == "pushed to helpers (2 ranks): lr=0.0001, cfg={'depth': 4}", r.stdout
    r = kernel.run("%pull helpers lr")
    assert "0.0001" in r.text, r.text + r.error_text
