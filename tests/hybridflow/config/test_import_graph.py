"""``hybridflow/config`` has no import circle, counting imports inside functions too (a circle held
together by a function-level import is still a circle)."""
import ast
import pathlib

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
