"""``python -m irdma.ops.cli``: the ``irdma`` command."""

from . import main

if __name__ == "__main__":
    main()
