"""Install the ``monarch`` kernelspec: ``python -m monarch_kernel install``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

KERNEL_NAME = "monarch"
DISPLAY_NAME = "Monarch (Python 3)"
#: The JupyterLab extension (labextension/), built into the package by ``make setup``.
LABEXTENSION = "monarch-kernel-labextension"
LABEXTENSION_BUILT = Path(__file__).resolve().parent.parent / "labextension"


def kernel_json() -> dict:
    return {
        "argv": [sys.executable, "-m", "monarch_kernel.kernel", "-f", "{connection_file}"],
        "display_name": DISPLAY_NAME,
        "language": "python",
        "interrupt_mode": "signal",
        "metadata": {"debugger": True},
    }


def install(user: bool = False, prefix: str | None = None) -> str:
    """Install the kernelspec; returns the directory it went to."""
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        with open(os.path.join(d, "kernel.json"), "w") as f:
            json.dump(kernel_json(), f, indent=1)
        return KernelSpecManager().install_kernel_spec(d, KERNEL_NAME, user=user, prefix=prefix)


def install_labextension(prefix: str) -> str | None:
    """Copy the prebuilt JupyterLab extension to ``PREFIX/share/jupyter/labextensions``
    (where JupyterLab finds prebuilt extensions); returns where, or None when this
    checkout has none built (a wheel installs it there by itself)."""
    if not (LABEXTENSION_BUILT / "package.json").exists():
        return None
    target = Path(prefix) / "share" / "jupyter" / "labextensions" / LABEXTENSION
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        shutil.rmtree(target)
    shutil.copytree(LABEXTENSION_BUILT, target)
    return str(target)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m monarch_kernel install",
        description="Install the monarch Jupyter kernelspec.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="into ~/.local/share/jupyter")
    where.add_argument("--sys-prefix", action="store_true", help="into this environment")
    where.add_argument("--prefix", help="into PREFIX/share/jupyter")
    args = p.parse_args(argv)
    prefix = sys.prefix if args.sys_prefix else args.prefix
    path = install(user=args.user, prefix=prefix)
    print(f"installed kernelspec {KERNEL_NAME!r} ({DISPLAY_NAME}) in {path}")
    if prefix is not None:  # the extension goes with an environment, not a user
        ext = install_labextension(prefix)
        if ext is not None:
            print(f"installed JupyterLab extension {LABEXTENSION} in {ext}")
