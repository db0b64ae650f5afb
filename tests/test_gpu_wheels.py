"""The wheels carried to a lent GPU machine, with the image's packages, serve every import of specd.

scripts/gpu_wheels.py derives the set from pyproject.toml and the image's package list
(scripts/gpu_image_packages.txt). The fast tests check the set against both, with no network:
every requirement in the closure is met, every import of the services and the CLI comes from a
carried or an image distribution, and taking any one wheel out fails the check. The slow test
(SPECD_WHEEL_TEST=1, with a Python 3.12 here) fetches the wheels and has pip itself resolve
specd's requirements from them, offline, in a clean Python 3.12 environment that stands in for
the image.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from functools import cache
from importlib.metadata import distribution, packages_distributions
from pathlib import Path

import pytest
from packaging.utils import NormalizedName, canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("specd", "specd_cli", "gateway", "draft_service", "verifier_service")


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "scripts" / "gpu_wheels.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


gpu_wheels = _load_script()
REQUIREMENTS = gpu_wheels.project_requirements()
IMAGE = gpu_wheels.image_packages()
PINS = gpu_wheels.derive(REQUIREMENTS, IMAGE)
CARRIED = {name: pin.version for name, pin in PINS.items()}


def imported_modules() -> dict[str, set[str]]:
    """Each third-party module that first-party code imports, with the files that import it.

    `from a.b import c` counts as `a.b.c`: c may be a module, and the longest name a
    distribution provides decides which distribution it is.
    """
    found: dict[str, set[str]] = {}
    for package in FIRST_PARTY:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [f"{node.module}.{alias.name}" for alias in node.names]
                else:
                    continue
                for name in names:
                    top = name.partition(".")[0]
                    if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                        found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


top_level_owners = cache(packages_distributions)


@cache
def modules_of(dist: str) -> frozenset[str]:
    """The modules, by dotted name, that a distribution installed here holds files of."""
    modules = set()
    for file in distribution(dist).files or ():
        if ".." not in file.parts and file.suffix in (".py", ".so"):
            stem = file.name.partition(".")[0]  # an extension module's name ends at its first dot
            modules.add(".".join([*file.parts[:-1], stem] if stem != "__init__" else file.parts[:-1]))
    return frozenset(modules)


def owners_of(name: str) -> set[NormalizedName]:
    """The distributions installed here that provide an imported name.

    importlib.metadata.packages_distributions() gives a namespace package's top level
    (opentelemetry, google) to every distribution with a file under it: of those, the ones
    holding the name's longest installed prefix.
    """
    candidates = {canonicalize_name(dist) for dist in top_level_owners().get(name.partition(".")[0], ())}
    if len(candidates) < 2:
        return candidates
    parts = name.split(".")
    for end in range(len(parts), 1, -1):
        if found := {dist for dist in candidates if ".".join(parts[:end]) in modules_of(dist)}:
            return found
    return candidates


def imports_not_provided(carried) -> dict[str, str]:
    """The imports that neither a carried distribution nor one of the image's provides: whose, and where."""
    provided = set(carried) | set(IMAGE)
    return {name: f"{', '.join(sorted(owners_of(name))) or 'not installed here'}; {', '.join(sorted(files))}"
            for name, files in sorted(imported_modules().items()) if not owners_of(name) & provided}


def test_the_set_and_the_image_meet_every_requirement():
    assert gpu_wheels.unmet(REQUIREMENTS, CARRIED, IMAGE) == []
    assert "torch" not in PINS
    assert "transformers" in PINS  # the image's 5.17.0 refuses every model
    listed = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_wheels.py"), "--list"],
                            capture_output=True, text=True, check=True, timeout=60).stdout
    assert [line.partition("  #")[0] for line in listed.splitlines()] == [
        f"{name}=={pin.version}" for name, pin in PINS.items()]


def test_every_import_of_the_services_is_carried_or_in_the_image():
    imports = imported_modules()
    assert {"grpc", "llguidance", "torch", "transformers"} <= {name.partition(".")[0] for name in imports}
    assert imports_not_provided(CARRIED) == {}


@pytest.mark.parametrize("name", list(PINS))
def test_taking_any_wheel_out_fails_the_check(name):
    carried = {other: version for other, version in CARRIED.items() if other != name}
    assert name in {canonicalize_name(requirement.name) for requirement, _ in
                    gpu_wheels.unmet(REQUIREMENTS, carried, IMAGE)}


def test_taking_an_imported_wheel_out_fails_the_import_check():
    carried = {name: version for name, version in CARRIED.items() if name != "llguidance"}
    assert {name.partition(".")[0] for name in imports_not_provided(carried)} == {"llguidance"}


def test_an_image_version_that_misses_a_requirement_is_carried_except_torch():
    older = {**IMAGE, "numpy": gpu_wheels.Version("1.26.4")}
    assert "numpy" in gpu_wheels.derive(REQUIREMENTS, older)
    with pytest.raises(SystemExit, match="torch"):
        gpu_wheels.derive(REQUIREMENTS, {**IMAGE, "torch": gpu_wheels.Version("2.10.0")})


def python312() -> str | None:
    """A Python 3.12 interpreter here: on PATH, uv's, or pyenv's (its shim fails where 3.12 is not global)."""
    candidates = [shutil.which("python3.12")]
    if uv := shutil.which("uv"):
        found = subprocess.run([uv, "python", "find", "3.12"], capture_output=True, text=True)
        candidates.append(found.stdout.strip() if found.returncode == 0 else None)
    candidates += sorted(str(path) for path in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))
    for candidate in filter(None, candidates):
        version = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                                 capture_output=True, text=True)
        if version.stdout.strip() == "True":
            return candidate
    return None


def placeholder_wheel(directory: Path, name: str, version: str) -> Path:
    """A wheel holding nothing but a distribution's name and version."""
    stem = f"{name.replace('-', '_')}-{version}"
    path = directory / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{stem}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: tests/test_gpu_wheels.py\n"
                       "Root-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{stem}.dist-info/RECORD", "")
    return path


@pytest.mark.skipif(os.environ.get("SPECD_WHEEL_TEST") != "1",
                    reason="fetches about 80 MB of wheels from the package registry: SPECD_WHEEL_TEST=1 runs it")
def test_pip_installs_specd_requirements_from_the_wheels_and_the_image_offline(tmp_path):
    """pip's own resolver, offline, in a clean Python 3.12: the image, then the wheels.

    The image's packages (CUDA torch and the rest) cannot be had here, so each is stood in for
    by a wheel of metadata alone at the image's version (0 where the list gives none, which
    meets only a requirement that names no version, as scripts/gpu_wheels.py counts it). They
    are installed first, as the image holds them, and require nothing: the image is taken to
    be consistent in itself. Then specd's requirements are installed from the fetched wheels
    with --no-index, dependencies and all: pip finds each missing one there or stops.
    """
    interpreter = python312()
    if interpreter is None:
        pytest.skip("no Python 3.12 here (python3.12 on PATH, `uv python find 3.12` or pyenv's)")
    wheels, image, venv = tmp_path / "wheels", tmp_path / "image", tmp_path / "venv"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_wheels.py"), "--dest", str(wheels)],
                   check=True, timeout=300)
    assert {canonicalize_name(path.name.partition("-")[0]) for path in wheels.glob("*.whl")} == set(PINS)
    image.mkdir()
    stand_ins = [placeholder_wheel(image, name, str(version or 0)) for name, version in IMAGE.items()]
    subprocess.run([interpreter, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    # This environment's pip runs the new one's interpreter, with no configuration: none of
    # this machine's own indexes or wheel folders.
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull

    def pip(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), *args],
                              capture_output=True, text=True, env=env, timeout=300)

    installed = pip("install", "--no-index", "--no-deps", "--no-compile", *map(str, stand_ins))
    assert installed.returncode == 0, installed.stderr
    requirements = [str(requirement) for requirement in REQUIREMENTS]
    # One wheel that only another carried one requires, set aside: pip walks the closure and stops.
    aside = next(wheels.glob("googleapis_common_protos-*.whl"))
    aside.rename(tmp_path / aside.name)
    without = pip("install", "--dry-run", "--no-index", "--find-links", str(wheels), *requirements)
    assert without.returncode != 0 and "googleapis-common-protos" in without.stderr, without.stderr
    (tmp_path / aside.name).rename(aside)
    installed = pip("install", "--no-index", "--no-compile", "--find-links", str(wheels), *requirements)
    assert installed.returncode == 0, installed.stderr
    checked = pip("check")
    assert checked.returncode == 0, checked.stdout
