"""`python -m mtrain ...` runs the same command line as the `mtrain` console script."""

from mtrain.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
