"""The standard kernel conformance suite (jupyter_kernel_test) against `monarch`."""

from __future__ import annotations

import os
import unittest

import jupyter_kernel_test as jkt
import pytest
from kernel_client import ensure_kernelspec, start_kernel

pytestmark = pytest.mark.local

ensure_kernelspec()


class MonarchKernelTests(jkt.KernelTests):
    kernel_name = "monarch"
    language_name = "python"
    file_extension = ".py"
    support_iopub_welcome = True

    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"
    completion_samples = [{"text": "zi", "matches": {"zip"}}]
    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n"]
    incomplete_code_samples = ["print('''hello", "def f(x):\n  x*2"]
    invalid_code_samples = ["import = 7q"]
    code_page_something = "zip?"
    code_generate_error = "raise ValueError('boom')"
    code_execute_result = [
        {"code": "1+2+3", "result": "6"},
        {"code": "[n*n for n in range(1, 4)]", "result": "[1, 4, 9]"},
    ]
    code_display_data = [
        {
            "code": "from IPython.display import HTML, display; display(HTML('<b>test</b>'))",
            "mime": "text/html",
        },
        {
            "code": "from IPython.display import Math, display; display(Math('\\\\frac{1}{2}'))",
            "mime": "text/latex",
        },
    ]
    code_history_pattern = "1?2*"
    supported_history_operations = ("tail", "search")  # "range" fails on every IPython kernel
    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"

    @classmethod
    def setUpClass(cls) -> None:
        # (the suite's own start picks TCP ports, which another process may take first)
        cls.km, cls.kc = start_kernel(cls.kernel_name, dict(os.environ))


if __name__ == "__main__":
    unittest.main()
