"""pyverbs (Debian's ``python3-pyverbs``), imported once for every verbs module of this package.

Debian installs pyverbs for the system python3 only: where it is not importable, its
dist-packages directory is added to ``sys.path`` so that any python3.11 finds it. And the
root logger is put back the way it was (see below). The verbs modules take pyverbs' names
from here, never from pyverbs itself, so that this runs first whichever of them is imported.
"""

from __future__ import annotations

import logging
import os

# pyverbs.base calls logging.basicConfig(level=INFO) when imported: that would configure the
# application's root logger behind its back (every INFO line of every library on stderr, as
# "[INFO] ... transport auto: picked tcp" at each irdma.connect). Undo it: the root logger is
# the application's to configure.
_root = logging.getLogger()
_root_state = (list(_root.handlers), _root.level)
try:  # Debian installs pyverbs for the system python3; let any python3.11 find it
    import pyverbs  # noqa: F401
except ImportError:  # pragma: no cover - depends on the machine
    import sys

    if os.path.isdir("/usr/lib/python3/dist-packages/pyverbs"):
        sys.path.append("/usr/lib/python3/dist-packages")

import pyverbs.enums as e  # noqa: E402
from pyverbs.addr import GID, AHAttr, GlobalRoute  # noqa: E402
from pyverbs.cq import CQ, CompChannel  # noqa: E402
from pyverbs.device import Context, get_device_list  # noqa: E402
from pyverbs.mr import MR  # noqa: E402
from pyverbs.pd import PD  # noqa: E402
from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError  # noqa: E402
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr  # noqa: E402
from pyverbs.wr import SGE, RecvWR, SendWR  # noqa: E402

_root.handlers[:], _root.level = _root_state[0], _root_state[1]
del _root, _root_state

__all__ = [
    "e", "GID", "AHAttr", "GlobalRoute", "CQ", "CompChannel", "Context", "get_device_list", "MR", "PD",
    "PyverbsError", "PyverbsRDMAError", "QP", "QPAttr", "QPCap", "QPInitAttr", "SGE", "RecvWR", "SendWR",
]
