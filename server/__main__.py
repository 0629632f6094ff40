"""``python -m irdma.server``: the same as ``irdma server``."""

from irdma.ops.cli import main

if __name__ == "__main__":
    main(["server", *__import__("sys").argv[1:]])
