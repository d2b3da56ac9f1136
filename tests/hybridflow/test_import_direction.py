"""DESIGN.md rule: imports go one way (checked on the code, lazy imports inside functions included).

    recipes -> hybridflow.trainer -> the rest of hybridflow (the core)
    workers -> the core and resharding
    resharding -> the core only

So the core never imports the trainer, ``workers``, ``resharding`` or ``recipes``; the trainer
never imports ``workers`` (roles are bound to worker classes by the recipe); ``workers`` never
imports the trainer; ``resharding`` imports neither ``workers`` nor the trainer.
"""
import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
TOP = ("hybridflow", "workers", "resharding", "recipes")


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute import of one of the project's packages."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            # `from hybridflow import trainer` names the subpackage in the alias
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if node.module in TOP]
    return [(line, m) for line, m in found if m.split(".")[0] in TOP]


def layer(module: str) -> str:
    """The layer a module (dotted name) belongs to."""
    parts = module.split(".")
    if parts[0] == "hybridflow":
        return "trainer" if len(parts) > 1 and parts[1] == "trainer" else "core"
    return parts[0]


ALLOWED = {
    "core": {"core"},
    "trainer": {"core", "trainer"},
    "resharding": {"core", "resharding"},
    "workers": {"core", "resharding", "workers"},
    "recipes": {"core", "trainer", "resharding", "workers", "recipes"},
}


def violations(source: str, module: str) -> list[str]:
    own = layer(module)
    return [f"{line}: {own} imports {target} ({layer(target)})" for line, target in imported_modules(source)
            if layer(target) not in ALLOWED[own]]


def test_every_package_imports_only_the_layers_below_it():
    offenders = []
    for pkg in TOP:
        for path in (REPO / pkg).rglob("*.py"):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            offenders += [f"{path.relative_to(REPO)}:{v}" for v in violations(path.read_text(), module)]
    assert not offenders, "imports against DESIGN.md's direction:\n" + "\n".join(offenders)


def test_the_checker_catches_each_form():
    assert violations("def f():\n    from workers.engines import fsdp\n", "hybridflow.export") == [
        "2: core imports workers.engines (workers)"]
    assert violations("from hybridflow import trainer", "hybridflow.config.validate") == [
        "1: core imports hybridflow.trainer (trainer)"]
    assert violations("import hybridflow.trainer.checkpoint", "workers.critic") == [
        "1: workers imports hybridflow.trainer.checkpoint (trainer)"]
    assert violations("from workers.critic import CriticWorker", "hybridflow.trainer.ppo_trainer") != []
    assert violations("from workers import checkpoint", "resharding.switch") != []
    assert violations("from hybridflow.protocol import DataProto\nfrom resharding import RNGStreams",
                      "workers.actor_rollout_ref") == []
    assert violations("from workers.critic import CriticWorker", "recipes.main_ppo") == []
    assert violations('"""workers.engines in prose"""', "hybridflow.device") == []
