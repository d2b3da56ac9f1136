"""DESIGN.md rule: only hybridflow/device.py touches torch.cuda (checked on the code, not on prose)."""
import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ["hybridflow", "workers", "resharding", "recipes", "scripts", "examples"]


def cuda_uses(source: str) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name)
                and node.value.id == "torch"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "cuda" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            if any(n and (n == "torch.cuda" or n.startswith("torch.cuda.")) for n in names):
                lines.append(node.lineno)
    return lines


def test_only_the_device_module_calls_torch_cuda():
    offenders = []
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            if path == REPO / "hybridflow" / "device.py":
                continue
            offenders += [f"{path.relative_to(REPO)}:{n}" for n in cuda_uses(path.read_text())]
    assert not offenders, "torch.cuda used outside hybridflow/device.py: " + ", ".join(offenders)


def test_the_checker_catches_each_form():
    assert cuda_uses("import torch\ntorch.cuda.synchronize()") == [2]
    assert cuda_uses("from torch import cuda") == [1]
    assert cuda_uses("import torch.cuda") == [1]
    assert cuda_uses('"""torch.cuda in prose"""') == []


def test_device_defaults_to_cpu_and_gloo_here():
    from hybridflow import device

    if device.device_type() == "cpu":
        assert device.dist_backend() == "gloo"
        assert str(device.torch_device()) == "cpu"
