"""The wheels a lent GPU machine needs to serve specd beside its image's own packages.

Such a machine (docs/performance.md, "GPU check") runs Python 3.12 with its own CUDA build of
torch and reaches no package registry: what specd needs beyond the image travels as wheels in
.whl/ (git ignores it; the call carries it, and scripts/gpu_check.sh installs it with --no-deps).
The set is derived, not listed: specd's requirements (pyproject.toml), then the requirements of
each distribution carried, as the running interpreter's environment holds it, with markers
evaluated for the machine's CPython 3.12 on Linux x86-64. A requirement that the image's own
package meets (scripts/gpu_image_packages.txt) is left to the image, and so are that package's
own requirements. Each wheel is pinned to the version installed here, the version the tests pass
with. Run it with .venv's interpreter (scripts/gpu_wheels.sh does):

    .venv/bin/python scripts/gpu_wheels.py          # fetch the wheels into .whl/
    .venv/bin/python scripts/gpu_wheels.py --list   # print the pins, with why each is carried

tests/test_gpu_wheels.py checks that the wheels and the image's packages together meet every
requirement and every import of the services, and installs them into a clean Python 3.12.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from importlib.metadata import distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
IMAGE_PACKAGES = ROOT / "scripts" / "gpu_image_packages.txt"
# The machine's interpreter, for the markers in requirements (python3 there is 3.12.3).
MACHINE = {"implementation_name": "cpython", "implementation_version": "3.12.3", "os_name": "posix",
           "platform_machine": "x86_64", "platform_python_implementation": "CPython", "platform_system": "Linux",
           "python_full_version": "3.12.3", "python_version": "3.12", "sys_platform": "linux"}
# Carried even where the image's version meets the requirement: the image's transformers (5.17.0)
# hands a model its KV cache as `past_key_values`, 5.24 on as `cache`, and 5.17 takes the unknown
# keyword silently and caches nothing, so specd refuses every model (docs/performance.md).
# pyproject.toml's floor of 5.24 carries it too; this keeps it carried if the floor ever moves.
CARRIED_REGARDLESS = (canonicalize_name("transformers"),)
# Never carried: a 500 MB wheel, and the image's is the CUDA build the machine is for.
NEVER_CARRIED = (canonicalize_name("torch"),)
# Every manylinux tag the image's glibc (2.39, Ubuntu 24.04) loads: pip matches each tag exactly,
# and some wheels are built for one newer than 2.28 only (llguidance's is manylinux_2_31).
PLATFORMS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{minor}_x86_64" for minor in range(5, 40))]


@dataclass(frozen=True)
class Pin:
    """A carried distribution: the version installed here, and a requirement that the image leaves unmet."""

    version: Version
    because: str


def project_requirements() -> list[Requirement]:
    """specd's runtime requirements: [project].dependencies, no extras."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return [Requirement(line) for line in tomllib.load(f)["project"]["dependencies"]]


def image_packages(path: Path = IMAGE_PACKAGES) -> dict[NormalizedName, Version | None]:
    """The image's packages and their versions, None where the version was not read."""
    packages: dict[NormalizedName, Version | None] = {}
    for line in path.read_text().splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            name, _, version = entry.partition("==")
            packages[canonicalize_name(name)] = Version(version) if version else None
    return packages


def image_meets(requirement: Requirement, image: Mapping[NormalizedName, Version | None]) -> bool:
    """Whether the image's own package meets a requirement.

    Not one with extras (which of the extra's packages the image holds, and at what version, is
    not known), and not a versioned one where the image's version was not read.
    """
    name = canonicalize_name(requirement.name)
    if name not in image or requirement.extras:
        return False
    version = image[name]
    if version is None:
        return not requirement.specifier
    return requirement.specifier.contains(version, prereleases=True)


@cache
def installed_version(name: NormalizedName) -> Version:
    """The version installed here: what a carried wheel is pinned to."""
    return Version(distribution(name).version)


@cache
def installed_requirements(name: NormalizedName) -> tuple[Requirement, ...]:
    """The Requires-Dist of the distribution installed here."""
    return tuple(Requirement(line) for line in distribution(name).requires or ())


def applies(requirement: Requirement, extras: Iterable[str] = ()) -> bool:
    """Whether the machine's interpreter needs a requirement, with the extras asked of its owner."""
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**MACHINE, "extra": extra}) for extra in ("", *extras))


def unmet(requirements: Iterable[Requirement], carried: Mapping[NormalizedName, Version],
          image: Mapping[NormalizedName, Version | None]) -> list[tuple[Requirement, str]]:
    """The requirements, each with what requires it, that the carried wheels and the image leave unmet.

    The walk starts at `requirements` (specd's) and goes on through each carried distribution's
    own, as installed here. A carried distribution takes the place of the image's, so it alone
    must meet what names it.
    """
    missing: list[tuple[Requirement, str]] = []
    asked: dict[NormalizedName, set[str]] = {}  # the extras asked of each carried distribution
    pending = [(requirement, "specd") for requirement in requirements]
    while pending:
        requirement, owner = pending.pop()
        if not applies(requirement, asked.get(canonicalize_name(owner), ())):
            continue
        name = canonicalize_name(requirement.name)
        if name not in carried:
            if not image_meets(requirement, image):
                missing.append((requirement, owner))
            continue
        if not requirement.specifier.contains(carried[name], prereleases=True):
            missing.append((requirement, owner))
        if name not in asked or not asked[name].issuperset(requirement.extras):
            asked.setdefault(name, set()).update(requirement.extras)
            pending.extend((own, name) for own in installed_requirements(name))
    return missing


def derive(requirements: list[Requirement],
           image: Mapping[NormalizedName, Version | None]) -> dict[NormalizedName, Pin]:
    """The wheels to carry: each distribution that a requirement the image leaves unmet names.

    Raises SystemExit where the image must provide a distribution and does not (torch), or where
    the version installed here does not meet a requirement (then this environment is broken).
    """
    pins = {name: Pin(installed_version(name), "carried whatever the image holds (CARRIED_REGARDLESS)")
            for name in CARRIED_REGARDLESS}
    while missing := unmet(requirements, carried := {name: pin.version for name, pin in pins.items()}, image):
        for requirement, owner in missing:
            name = canonicalize_name(requirement.name)
            if name in NEVER_CARRIED:
                raise SystemExit(f"{owner} needs {requirement}, which the image's {name} "
                                 f"({image.get(name, 'none')}) does not meet, and {name} is never carried")
            if name in carried:
                raise SystemExit(f"{owner} needs {requirement}, but this environment holds {name} {carried[name]}")
            pins.setdefault(name, Pin(installed_version(name), f"{requirement.name}{requirement.specifier} ({owner})"))
    return dict(sorted(pins.items()))


def download(pins: Mapping[NormalizedName, Pin], dest: Path) -> None:
    """The CPython 3.12 wheels of the pins, without their dependencies, into a fresh `dest`."""
    shutil.rmtree(dest, ignore_errors=True)
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--dest", str(dest), "--python-version", "3.12", "--implementation", "cp", *platforms,
                    *(f"{name}=={pin.version}" for name, pin in pins.items())], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the pins, one a line, and fetch nothing")
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl", help="where the wheels go (emptied first)")
    args = parser.parse_args()
    pins = derive(project_requirements(), image_packages())
    if args.list:
        for name, pin in pins.items():
            print(f"{name}=={pin.version}  # {pin.because}")
        return 0
    download(pins, args.dest)
    wheels = list(args.dest.glob("*.whl"))
    size = sum(wheel.stat().st_size for wheel in wheels) / 2**20
    print(f"{len(wheels)} wheels, {size:.0f} MiB, in {args.dest}: {' '.join(pins)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
