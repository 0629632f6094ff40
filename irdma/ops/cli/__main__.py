"""``python -m irdma.ops.cli``: the ``irdma`` command."""

from . import main

main()
