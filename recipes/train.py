"""Entry point for `accelerate launch --config_file configs/accelerate/X.yaml recipes/train.py RECIPE [--set k=v]`.

It only parses the command line and hands over to the same code as `mtrain train`.
"""

import sys

from mtrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
