"""The house's shape: layers without cycles, a torch-free core, one reader of the environment, and docs that
name only modules that exist. (The layer order itself is import-linter's contract in pyproject.toml, checked
by `make lint`; here the same graph, built by grimp, is searched for cycles that contract allows.)"""

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minivllm"


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of nodes that reach one another (an import cycle, if larger than 1)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def import_graph() -> dict[str, set[str]]:
    """module -> the minivllm modules it imports, imports inside functions included, type hints not."""
    graph = grimp.build_graph("minivllm", exclude_type_checking_imports=True)
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def test_no_module_imports_itself_through_others(import_graph):
    assert strongly_connected(import_graph) == []


def test_no_two_packages_import_each_other(import_graph):
    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    packages: dict[str, set[str]] = {}
    for module, imported in import_graph.items():
        packages.setdefault(package(module), set()).update(
            package(m) for m in imported if package(m) != package(module))
    assert strongly_connected(packages) == []


def test_the_scheduler_loads_no_torch():
    code = ("import sys, minivllm.core.scheduler; "
            "print('torch' in sys.modules, sum(m.startswith('minivllm') for m in sys.modules))")
    torch_loaded, modules = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True, cwd=ROOT).stdout.split()
    assert torch_loaded == "False"
    assert int(modules) <= 15


def test_the_root_package_loads_names_on_first_use():
    import minivllm

    assert sorted(minivllm.__all__) == sorted(minivllm.MODULE_ATTRS)
    for name in minivllm.__all__:
        assert getattr(minivllm, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        minivllm.Nope  # noqa: B018


def test_only_envs_reads_the_environment():
    readers = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
               if re.search(r"os\.environ|os\.getenv|getenv\(", p.read_text()) and p.name != "envs.py"]
    assert readers == []


def test_every_env_variable_is_documented():
    from minivllm import envs

    for name, var in envs.VARIABLES.items():
        assert var.doc, name
    mentioned = set()
    for path in PACKAGE.rglob("*.py"):
        mentioned.update(re.findall(r"envs\.([A-Z][A-Z0-9_]+)", path.read_text()))
    assert mentioned <= set(envs.VARIABLES)


# ---- docs name what exists -------------------------------------------------------------------------------
PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w-]+\.(?:py|cpp|h|md|sh|ipynb))\b")
DOTTED = re.compile(r"`(minivllm(?:\.\w+)+)`")


# named in prose but not ours: vLLM's example scripts the README runs, the results `make gpu-check` writes,
# the chapters' naming pattern; logger names look like module paths
NOT_OURS = {"basic/basic.py", "basic/generate.py", "basic/chat.py", "logits_processor/custom.py",
            "bench/gpu_check_results.md", "chapters/NN_slug.py", "minivllm.server.requests"}


def texts(path: Path):
    """The docstrings and comments of a Python file, the comments of a C++ one, or a whole text file."""
    source = path.read_text()
    if path.suffix in (".cpp", ".h"):
        yield "\n".join(line.split("//", 1)[1] for line in source.splitlines() if "//" in line)
        return
    if path.suffix != ".py":
        yield source
        return
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield doc
    yield "\n".join(line.split("#", 1)[1] for line in source.splitlines() if "#" in line)


def exists(named: str, where: Path) -> bool:
    """A path as prose writes it: from the repository, from the package, or from the file's own folder."""
    return any((base / named).exists() for base in (ROOT, PACKAGE, where.parent, where.parent.parent))


def documented_files():
    yield from PACKAGE.rglob("*.py")
    yield from PACKAGE.rglob("*.cpp")
    yield from PACKAGE.rglob("*.h")
    yield from (ROOT / "chapters").glob("*.py")
    yield from (ROOT / "bench").glob("*.py")
    yield ROOT / "README.md"


def test_docs_name_only_files_that_exist():
    missing = [f"{path.relative_to(ROOT)}: {named}" for path in documented_files() for text in texts(path)
               for named in PATH.findall(text) if not exists(named, path) and named not in NOT_OURS
               and not named.startswith("vllm/")]  # vLLM's own files, named as the model we learn from
    assert missing == []


def test_docs_name_only_modules_that_exist():
    missing = []
    for path in documented_files():
        for text in texts(path):
            for dotted in set(DOTTED.findall(text)) - NOT_OURS:
                parts = dotted.split(".")
                for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
                    try:
                        obj = importlib.import_module(".".join(parts[:cut]))
                    except ImportError:
                        continue
                    for attr in parts[cut:]:
                        obj = getattr(obj, attr, None)
                    if obj is None:
                        missing.append(f"{path.relative_to(ROOT)}: {dotted}")
                    break
    assert missing == []


def test_what_the_chapters_read_stays_readable():
    """The issue's budget: the code the chapters read line by line (bench/house.py's CHAPTER_READ
    rooms) stays within 5,000 lines, and every file of the package belongs to a room there."""
    spec = importlib.util.spec_from_file_location("house", ROOT / "bench" / "house.py")
    house = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(house)
    counts = house.lines_per_room()  # raises for a file in no room
    read = sum(counts[room] for room in house.CHAPTER_READ)
    assert read <= 5_000, f"the chapters' code has grown to {read} lines: {dict(counts)}"
