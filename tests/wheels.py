"""Wheels of the two distributions, built from copies of the sources (building in the checkout
would leave a build/ folder there) and installed into a folder of their own: ``pagedlab``, what
students install, and ``pagedlab-course``, the instructors' grader and the book's tooling."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IGNORE = shutil.ignore_patterns("__pycache__", "*.egg-info")


def build(distribution: str, folder: Path) -> Path:
    """The wheel of ``"pagedlab"`` or ``"pagedlab-course"``, built under ``folder``."""
    source = folder / f"source-{distribution}"
    if distribution == "pagedlab":
        shutil.copytree(ROOT / "pagedlab", source / "pagedlab", ignore=IGNORE)
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            shutil.copy(ROOT / name, source / name)
    else:
        shutil.copytree(ROOT / "course", source, ignore=IGNORE)
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel",
                    str(source), "--no-deps", "--no-build-isolation", "-w", str(folder / "wheels")],
                   check=True, cwd=folder, timeout=600)
    (wheel,) = (folder / "wheels").glob(f"{distribution.replace('-', '_')}-*.whl")
    return wheel


def install(folder: Path, *distributions: str) -> Path:
    """A folder for PYTHONPATH holding the ``distributions``, each installed from its wheel."""
    site = folder / "site"
    wheels = [str(build(d, folder)) for d in distributions]
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install",
                    *wheels, "--no-deps", "--no-index", "--target", str(site)],
                   check=True, cwd=folder, timeout=600)
    return site
