"""The pinned CPU stack (constraints-cpu.txt): every package `make setup` installs at an exact version, and this
environment installed from it (what makes two fresh clones train to the same digits)."""

from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (REPO / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            package, sep, version = line.partition("==")
            assert sep and version and " " not in line, f"{name}: {line!r} is not an exact pin (NAME==VERSION)"
            pins[package.lower().replace("_", "-")] = version
    return pins


@pytest.mark.parametrize("name", ["constraints-cpu.txt", "constraints-vllm-cpu.txt"])
def test_every_package_is_pinned_exactly(name):
    pins = _pins(name)
    assert pins["torch"] == "2.13.0"  # the CPU build's public version: a CUDA torch cannot satisfy the file
    assert {"transformers", "numpy", "tokenizers", "pip"} <= set(pins)
    if name == "constraints-cpu.txt":
        assert {"deepspeed", "triton", "datasets", "wandb", "mosaicml-streaming", "gguf"} <= set(pins)


def test_this_environment_is_the_pinned_stack():
    """The packages installed here that the lock names are at the locked versions (make setup installs with it)."""
    pins = _pins("constraints-cpu.txt")
    # the environment's own site-packages only: once a test has imported setuptools, its vendored copies (older
    # packaging, platformdirs) are on sys.path too, and are not what the environment installed
    import sysconfig

    where = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in metadata.distributions(path=where)}
    if installed.get("torch", "").split("+")[0] != pins["torch"]:
        pytest.skip("not the CPU stack of make setup (another torch): a GPU machine's install")
    differ = {p: (installed[p], v) for p, v in pins.items()
              if p in installed and installed[p].split("+")[0] != v.split("+")[0]}
    assert not differ, f"installed (have, locked): {differ}; run make setup (or make lock after an upgrade)"
