"""``python -m trellis.cli``: the ``trellis`` command without the installed console script."""

from trellis.cli.main import entry

if __name__ == "__main__":
    entry()
