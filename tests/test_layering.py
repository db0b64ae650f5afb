"""The layering rule: shared core → worker runtime → services → application, never upward
or sideways.

    core         specd (but not specd.worker): what both sides share, the wire
                 types, sampling, rejection, settings, telemetry, errors, the gRPC plumbing
    worker       specd.worker: the model runtime both worker services run; imports the core only
    services     draft_service and verifier_service import the core and the worker runtime;
                 gateway imports the core only (it runs no model)
    application  specd_cli: the `specd` command and its tools, the only importer of services

Checked twice: statically, every import statement of every module (those inside
functions too, which an import at run time would only reach when called); and by
importing each layer in a fresh interpreter and looking at what it pulled in.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVICES = ("draft_service", "verifier_service", "gateway")
WORKERS = ("draft_service", "verifier_service")  # the services that run a model
APPLICATION = "specd_cli"
WORKER = "specd.worker"
# The pure math imports no gRPC (docs/design.md §1).
MATH = ("specd.sampling", "specd.rejection", "gateway.stats.costmodel")


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer(module: str) -> str | None:
    """"core", "worker", a service package's name, "application", or None (not ours)."""
    if _within(module, APPLICATION):
        return "application"
    if _within(module, WORKER):
        return "worker"
    root = module.split(".")[0]
    if root in SERVICES:
        return root
    return "core" if root == "specd" else None


def allowed(importer: str, imported: str | None) -> bool:
    """May a module of layer `importer` import one of layer `imported`?"""
    if importer == "application" or imported is None or imported == "core":
        return True
    if imported == "worker":  # the model runtime: the workers' own, never the gateway's
        return importer == "worker" or importer in WORKERS
    return imported == importer  # a service imports itself; nobody imports the application


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def our_modules() -> list[str]:
    paths = [p for root in ("specd", *SERVICES, APPLICATION) for p in sorted((REPO / root).rglob("*.py"))]
    return [module_name(p) for p in paths]


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _running(tree: ast.Module, functions: bool) -> Iterator[ast.AST]:
    """The nodes of `tree` whose code runs: none in an `if TYPE_CHECKING:` block, and, unless
    `functions`, none in a function's body (what runs when the module is imported)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if not functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            # Its decorators and defaults run when it is defined, its body when it is called.
            stack.extend([*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)])
            stack.extend(getattr(node, "decorator_list", []))
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(module: str, scope: str = "anywhere") -> list[tuple[int, str]]:
    """(line, module) of every import in `module`'s source, wherever it stands (`scope`
    "anywhere"), or of those that run ("run": not under `if TYPE_CHECKING:`), or of those
    that run when the module is imported ("load": not in a function's body either); `from A
    import B` counts as A and A.B (B may be a submodule); relative imports are resolved."""
    path = REPO / Path(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    nodes = ast.walk(tree) if scope == "anywhere" else _running(tree, functions={"run": True, "load": False}[scope])
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module")))):
            found.append((node.lineno, node.args[0].value))
    return found


def test_the_scan_sees_imports_inside_functions():
    hidden = [name for _, name in imports_of("specd_cli.launch") if layer(name) in SERVICES]
    assert "draft_service.server" in hidden and "gateway.app" in hidden  # both inside functions


@pytest.mark.parametrize("module", [m for m in our_modules() if layer(m) != "application"])
def test_no_module_imports_upward_or_sideways(module):
    mine = layer(module)
    wrong = [f"line {line}: {name} ({layer(name)})" for line, name in imports_of(module)
             if not allowed(mine, layer(name))]
    assert not wrong, f"{module} ({mine}) imports what its layer may not: {wrong}"


def test_the_top_level_folders_import_one_another_without_a_cycle():
    """A folder's place in the tree is its layer: the application (specd_cli) sits beside the
    services, not inside the core's folder, so no folder imports one that imports it back."""
    folders: dict[str, set[str]] = {}
    for module in our_modules():
        folder = module.split(".")[0]
        folders.setdefault(folder, set()).update(
            name.split(".")[0] for _, name in imports_of(module) if layer(name) is not None)
    for folder, imported in folders.items():
        for other in imported - {folder}:
            assert folder not in folders.get(other, set()), f"{folder} imports {other}, which imports {folder}"


def cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """One cycle (its modules in import order, the first again at the end) through each
    strongly connected group of `graph` (module → the modules it imports) of two or more."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, []):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(group) > 1:
                found.append(_cycle_in(graph, set(group)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _cycle_in(graph: dict[str, list[str]], group: set[str]) -> list[str]:
    """A shortest cycle through the group's first module, by breadth-first search."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for other in graph.get(node, []):
                if other == start:  # back where it began: the path there, and the way back
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if other in group and other not in came_from:
                    came_from[other] = node
                    following.append(other)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


# Packages whose modules import one another without a cycle (every package of ours).
ACYCLIC = ("specd", *SERVICES, APPLICATION)


def import_graph(scope: str) -> dict[str, list[str]]:
    """Each module of ACYCLIC → those of ours it imports (`imports_of` at `scope`); a module's
    own packages are left out: Python imports them before it, so they never close a cycle."""
    modules = [m for m in our_modules() if m.split(".")[0] in ACYCLIC]
    known = set(modules)
    return {m: sorted({name for _, name in imports_of(m, scope) if name in known and not _within(m, name)})
            for m in modules}


def test_the_cycle_search_finds_a_cycle_and_the_scopes_leave_out_what_does_not_run():
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": [], "e": ["a"]}) == [["a", "b", "c", "a"]]
    assert cycles({"a": ["b"], "b": [], "c": ["a"]}) == []
    # specd_cli.loadbench imports specd.tls under `if TYPE_CHECKING:` (ClientTLS) and in a
    # function (aio_channel); specd_cli.serve imports specd_cli.certs in functions only.
    loadbench = {scope: {name for _, name in imports_of("specd_cli.loadbench", scope)}
                 for scope in ("anywhere", "run", "load")}
    assert {"specd.tls.ClientTLS", "specd.tls.aio_channel"} <= loadbench["anywhere"]
    assert "specd.tls.ClientTLS" not in loadbench["run"] and "specd.tls.aio_channel" in loadbench["run"]
    assert not {name for name in loadbench["load"] if _within(name, "specd.tls")}
    serve = {scope: {name for _, name in imports_of("specd_cli.serve", scope)} for scope in ("run", "load")}
    assert "specd_cli.certs" in serve["run"] and "specd_cli.certs" not in serve["load"]


@pytest.mark.parametrize("scope", ["load", "run"])
def test_no_module_imports_one_that_imports_it_back(scope):
    """No import cycle among our modules: none among the imports that run when a module is
    imported ("load": a cycle there fails or half-initializes a module, depending on which
    is imported first), and none either counting the imports inside functions ("run": a
    cycle there is two modules that each need the other, which one of them should not)."""
    found = cycles(import_graph(scope))
    assert not found, "import cycles: " + "; ".join(" → ".join(cycle) for cycle in found)


@pytest.mark.parametrize("module", MATH)
def test_the_math_imports_no_grpc(module):
    assert not [name for _, name in imports_of(module) if name.split(".")[0] == "grpc"]


_PULLED_IN = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


def pulled_in(modules: list[str]) -> list[str]:
    """The modules a fresh interpreter holds after importing `modules`."""
    run = subprocess.run([sys.executable, "-c", _PULLED_IN, *modules], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("package", ["core", "worker", *SERVICES])
def test_importing_a_layer_pulls_in_nothing_above_it(package):
    """Every module of the layer in one interpreter: what they pull in together is the union
    of what each pulls in alone, so one process answers for all; on a failure, one process
    per module names the culprit."""
    modules = [m for m in our_modules() if layer(m) == package]
    assert modules

    def wrong(names: list[str]) -> list[str]:
        return [name for name in names if not allowed(package, layer(name))]

    if wrong(pulled_in(modules)):
        culprits = {m: wrong(pulled_in([m])) for m in modules}
        pytest.fail(f"importing the {package} layer pulls in {({m: w for m, w in culprits.items() if w})}")


def test_the_gateways_records_and_policies_load_neither_grpc_nor_torch():
    """The policies, the step records and the request types are plain: a module that borrows
    one of their types does not load the engine, gRPC or torch with it."""
    loaded = pulled_in(["gateway.step.records", "gateway.request", "gateway.policy.gamma", "gateway.proposers.hybrid",
                        "specd.steps"])
    heavy = ("grpc", "torch", "transformers", "gateway.step.engine", "gateway.workers.links", "gateway.workers.backend")
    assert not [m for m in loaded if any(_within(m, h) for h in heavy)]


def test_the_gateways_step_code_loads_no_model_code():
    """The links and the step types they return are plain: importing them loads neither
    transformers nor the workers' runtime (the gateway's tokenizer, in `gateway.workers.backend`, does)."""
    loaded = pulled_in(["gateway.workers.links", "specd.steps", "specd.wire"])
    assert not [m for m in loaded if m.split(".")[0] == "transformers" or m.startswith("specd.worker")]


def test_the_maps_name_every_module():
    """specd/__init__.py and specd/worker/__init__.py map their modules one by one, and the
    README's Layout names every module of the core, the worker runtime, the application and
    the gateway: a new module goes on both maps."""
    for package, depth in (("core", 1), ("worker", 2)):
        folder = REPO / Path(*(["specd"] if package == "core" else ["specd", "worker"]))
        mapping = (folder / "__init__.py").read_text(encoding="utf-8")
        mapped = {line.split()[0] for line in mapping.splitlines() if line.startswith("    ") and line.strip()}
        modules = {m.split(".")[depth] for m in our_modules() if layer(m) == package and m.count(".") == depth}
        assert modules <= mapped, f"{folder.relative_to(REPO)}/__init__.py does not map {sorted(modules - mapped)}"

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    layout = readme[readme.index("## Layout"):]
    layout = layout[:layout.index("\n## ")] if "\n## " in layout else layout
    folders = ("specd", "specd/worker", "specd_cli", "gateway", *GATEWAY_ROOMS)
    files = {path.name for folder in folders for path in (REPO / folder).glob("*.py")
             if path.name not in ("__init__.py", "__main__.py")}
    missing = sorted(f for f in files if f not in layout)
    assert not missing, f"the README's Layout does not name {missing}"


# The gateway's rooms: its sub-packages, each a folder a newcomer finds by name.
GATEWAY_ROOMS = tuple(str(p.relative_to(REPO)) for p in sorted((REPO / "gateway").iterdir())
                      if (p / "__init__.py").is_file())


def _gateway_place(module: str) -> str | None:
    """A gateway module's place in its floor plan: its room (`gateway.step`), or itself
    when it stands at the top level (`gateway.core`)."""
    parts = module.split(".")
    if parts[0] != "gateway" or len(parts) < 2:
        return None
    return ".".join(parts[:2])


def test_the_gateways_rooms_and_top_level_modules_import_one_another_without_a_cycle():
    """No arrow runs back up inside the gateway: taking each room as one place and each
    top-level module as its own, every import (those inside functions and under
    TYPE_CHECKING too) runs one way."""
    arrows: dict[str, set[str]] = {}
    for module in our_modules():
        place = _gateway_place(module)
        if place is not None:
            arrows.setdefault(place, set()).update(
                other for _, name in imports_of(module) if (other := _gateway_place(name)) not in (None, place))
    assert len(arrows) > len(GATEWAY_ROOMS)  # the scan found the rooms and the top level
    assert not cycles({place: sorted(others) for place, others in arrows.items()})


def test_the_gateways_top_level_stays_small():
    """Rooms, not an open-plan floor: at most 12 modules at gateway/'s top level."""
    top = sorted(p.name for p in (REPO / "gateway").glob("*.py"))
    assert len(top) <= 12, top
    assert len(GATEWAY_ROOMS) >= 6, GATEWAY_ROOMS
