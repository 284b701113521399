"""README.md: what the project is and the first command on its first screen, no line over
100 characters, the release path (``nox -s build``) in its install section, and the noxfile
session it names."""

from __future__ import annotations

import re
from pathlib import Path

import ttt

REPO = Path(__file__).resolve().parents[3]
README = (REPO / "README.md").read_text()
FIRST_SCREEN = 40
PYPROJECT = (REPO / "packages" / "ttt" / "pyproject.toml").read_text()


def _dependencies() -> list[str]:
    listed = re.search(r"^dependencies = \[(.*?)\]", PYPROJECT, re.MULTILINE).group(1)
    return re.findall(r'"([^"]+)"', listed)


def test_the_first_screen_says_what_it_is_and_the_first_command():
    screen = "\n".join(README.splitlines()[:FIRST_SCREEN])
    assert "TTT-linear" in screen and "PyTorch" in screen
    assert "ttt.chunk_ttt_linear" in screen
    assert "```bash\npython3 -m pip install nox && nox -s demo\n```" in screen


def test_no_line_is_over_100_characters():
    long = [(n, len(line)) for n, line in enumerate(README.splitlines(), 1) if len(line) > 100]
    assert long == []


def test_the_install_section_shows_the_release_path():
    install = README.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "nox -s build" in install
    version = re.search(r'^version = "(.*)"', PYPROJECT, re.MULTILINE).group(1)
    assert version == ttt.__version__
    for wheel in re.findall(r"dist/(\S+\.whl)", install):
        assert f"-{version}-py3-none-any.whl" in wheel, wheel
    noxfile = (REPO / "noxfile.py").read_text()
    assert "def build(session" in noxfile
    assert '"build"' not in noxfile.split("nox.options.sessions = ", 1)[1].split("\n", 1)[0]


def test_the_stated_oldest_torch_is_the_one_the_package_requires():
    torch_requirement = next(d for d in _dependencies() if d.startswith("torch"))
    oldest = re.fullmatch(r"torch>=(\d+\.\d+)", torch_requirement).group(1)
    assert f"torch {oldest} or later" in README
    noxfile = (REPO / "noxfile.py").read_text()
    assert re.search(rf'OLDEST_TORCH = "torch=={re.escape(oldest)}\.\d+"', noxfile)


def test_ttt_does_not_depend_on_numpy():
    assert not any(d.startswith("numpy") for d in _dependencies())
    sources = (REPO / "packages" / "ttt" / "src" / "ttt").rglob("*.py")
    assert not [p for p in sources if re.search(r"^\s*(import|from) numpy", p.read_text(),
                                                re.MULTILINE)]
