"""mypy --strict (setup.cfg) on the package as it is installed: ``fs/`` as ``irdma.fs`` and
``server/`` as ``irdma.server``.

setup.cfg's ``package_dir`` maps them there, but mypy reads directories, not import hooks: run
on the source tree it names them ``fs`` and ``server`` and types every import between them and
``irdma`` as ``Any``. This builds a tree of symbolic links (``build/typecheck/irdma`` with
``fs`` and ``server`` inside) and runs mypy on it. Exit status: mypy's.

Usage: python tools/typecheck.py [MYPY ARGS...]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tree(root: str) -> str:
    """The linked package under ``root`` (made again each time); returns the ``irdma`` path."""
    pkg = os.path.join(root, "irdma")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(pkg)
    for name in os.listdir(os.path.join(REPO, "irdma")):
        if name != "__pycache__":
            os.symlink(os.path.join(REPO, "irdma", name), os.path.join(pkg, name))
    for sub in ("fs", "server"):
        os.symlink(os.path.join(REPO, sub), os.path.join(pkg, sub))
    return pkg


def main() -> int:
    root = os.path.join(REPO, "build", "typecheck")
    tree(root)
    cmd = [sys.executable, "-m", "mypy", "--config-file", os.path.join(REPO, "setup.cfg"),
           "--cache-dir", os.path.join(REPO, "build", "mypy-cache"), *sys.argv[1:], "irdma"]
    return subprocess.run(cmd, cwd=root).returncode


if __name__ == "__main__":
    sys.exit(main())
