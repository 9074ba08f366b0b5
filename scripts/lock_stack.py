"""Write the exact CPU stack of a venv as a pip constraints file: `make lock` runs this for .venv and .venv-vllm.

    python scripts/lock_stack.py PYTHON OUT [PYTHON OUT ...]

Every installed package at its installed version (pip's freeze), mtrain itself and the build tools left out; torch
as its public version (2.13.0, which the CPU build 2.13.0+cpu satisfies), so the file keeps a CPU install CPU-only.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

HEADER = """# The CPU stack `make setup` installs into {venv}, every package at the version it resolved on {date}, so two
# fresh clones install the same stack and train the same model to the last digit. torch stays the CPU build: a
# package that wants another torch fails instead of pulling a CUDA build. Written by `make lock`
# (scripts/lock_stack.py) after a deliberate upgrade (`make setup CONSTRAINTS=`, then the tests).
"""
LEFT_OUT = ("mtrain", "setuptools", "wheel")


def pins(python: str) -> list[str]:
    out = subprocess.run([python, "-m", "pip", "freeze", "--exclude-editable", "--all"], check=True,
                         capture_output=True, text=True).stdout.splitlines()
    lines = []
    for line in out:
        name, sep, version = line.partition("==")
        if not sep or name.lower() in LEFT_OUT:
            continue  # editable or direct-URL installs, mtrain, build tools
        lines.append(f"{name}=={version.split('+')[0] if name.lower() == 'torch' else version}")
    return sorted(lines, key=str.lower)


def main(argv: list[str]) -> int:
    if not argv or len(argv) % 2:
        print(__doc__, file=sys.stderr)
        return 2
    for python, out in zip(argv[::2], argv[1::2]):
        venv = python.rsplit("/bin/", 1)[0]
        text = HEADER.format(venv=venv, date=datetime.date.today().isoformat()) + "\n".join(pins(python)) + "\n"
        with open(out + ".tmp", "w") as f:
            f.write(text)
        os.replace(out + ".tmp", out)
        print(f"wrote {out}: {text.count(chr(10)) - HEADER.count(chr(10))} packages")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
