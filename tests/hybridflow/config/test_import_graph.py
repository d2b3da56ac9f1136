"""``hybridflow/config`` has no import circle, counting imports inside functions too (a circle held
together by a function-level import is still a circle); hybridflow's modules and config's import
without a circle at load time, and each one imports first in a fresh interpreter."""
import ast
import pathlib
import subprocess
import sys

CONFIG = pathlib.Path(__file__).resolve().parents[3] / "hybridflow" / "config"
PACKAGE = "hybridflow.config"


def config_imports(source: str) -> set[str]:
    """The modules of hybridflow.config that one module imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            # `from hybridflow.config import load` names the module in the alias
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m.removeprefix(PACKAGE + ".") for m in found if m.startswith(PACKAGE + ".")}


def graph() -> dict[str, set[str]]:
    modules = {p.stem: p for p in CONFIG.glob("*.py") if p.stem != "__init__"}
    return {name: config_imports(path.read_text()) & set(modules) - {name} for name, path in modules.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules (first == last), or None."""
    state: dict[str, str] = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    return next((c for n in sorted(edges) if n not in state for c in [visit(n, [n])] if c), None)


def test_the_config_package_has_no_import_circle():
    found = cycle(graph())
    assert found is None, "import circle in hybridflow/config: " + " -> ".join(found)


def test_the_checker_finds_a_circle_through_a_function_level_import():
    source = "def f():\n    from hybridflow.config.sft import SFTConfig\n"
    assert config_imports(source) == {"sft", "sft.SFTConfig"}
    assert cycle({"load": {"verl_inert"}, "verl_inert": {"sft"}, "sft": {"load"}}) == [
        "load", "verl_inert", "sft", "load"]
    assert cycle({"a": {"b"}, "b": set()}) is None


# hybridflow's own modules beside config, and config's, each imported first in a fresh interpreter:
# a circle through a package's __init__ fails only for the module a process happens to load first
ROOT = CONFIG.parents[1]
ALONE = ["hybridflow.config", "hybridflow.model_checks", "hybridflow.model_files", "hybridflow.host_checks",
         "hybridflow.auto_fsdp_size", "hybridflow.auto_cpu_layout", "hybridflow.errors"] + sorted(
    f"{PACKAGE}.{p.stem}" for p in CONFIG.glob("*.py") if p.stem != "__init__")


def test_each_module_imports_on_its_own():
    script = ("import subprocess, sys\n"
              "failed = [m for m in sys.argv[1:] if subprocess.run([sys.executable, '-c', f'import {m}'],"
              " capture_output=True).returncode]\n"
              "print(' '.join(failed))")
    out = subprocess.run([sys.executable, "-c", script, *ALONE], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.split() == [], "import fails when loaded first: " + out.stdout


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def load_time_imports(tree: ast.Module, importer: str) -> set[str]:
    """Modules imported while ``importer`` loads: top-level statements, class bodies, if/try blocks;
    not function bodies nor ``if TYPE_CHECKING:`` blocks, which run later or never."""
    found, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        todo += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
    # importing a.b.c runs a.b's __init__ first, unless the importer is inside a.b (then it is running)
    packages = {m.rsplit(".", 1)[0] for m in found if "." in m}
    return found | {p for p in packages if not importer.startswith(p + ".") and importer != p}


def hybridflow_graph() -> dict[str, set[str]]:
    files = list(ROOT.joinpath("hybridflow").glob("*.py")) + list(CONFIG.glob("*.py"))
    names = {module_name(p): p for p in files}
    return {name: load_time_imports(ast.parse(path.read_text()), name) & set(names) - {name}
            for name, path in names.items()}


def test_hybridflow_and_its_config_import_without_a_circle():
    found = cycle(hybridflow_graph())
    assert found is None, "import circle at load time: " + " -> ".join(found)


def test_the_load_time_graph_sees_a_package_init():
    """The circle this test was written for: model_checks imported the config package, whose __init__
    imported validate, which imports model_checks."""
    tree = ast.parse("from hybridflow.config.derived import needs_critic\n"
                     "if TYPE_CHECKING:\n    from hybridflow.config.root import RootConfig\n"
                     "def f():\n    import hybridflow.device\n")
    assert load_time_imports(tree, "hybridflow.model_checks") == {
        "hybridflow.config.derived", "hybridflow.config.derived.needs_critic", "hybridflow.config"}
    assert load_time_imports(tree, "hybridflow.config.validate") == {
        "hybridflow.config.derived", "hybridflow.config.derived.needs_critic"}
