"""P3 priority slicing and layer dropping, under their training-layer name. The code is
:mod:`irdma.client.comm` (the client's shard windows use it); the xattrs and their parsers are in
:mod:`irdma.xattrs`."""

from irdma.client.comm import (
    PriorityWindow,
    ResidualCache,
    Scheduling,
    check_priority,
    check_slice,
    current,
    priority,
)
from irdma.xattrs import (
    DEFAULT_SLICE_ELEMS,
    MAX_PRIORITY,
    XATTR_DROP,
    XATTR_PRIORITY,
    XATTR_SLICE,
    XATTRS,
    parse_drop,
    parse_priority,
    parse_slice,
)

__all__ = [
    "DEFAULT_SLICE_ELEMS",
    "MAX_PRIORITY",
    "PriorityWindow",
    "ResidualCache",
    "Scheduling",
    "XATTRS",
    "XATTR_DROP",
    "XATTR_PRIORITY",
    "XATTR_SLICE",
    "check_priority",
    "check_slice",
    "current",
    "parse_drop",
    "parse_priority",
    "parse_slice",
    "priority",
]
