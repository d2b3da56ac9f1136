"""Keep transformers' model classes as transformers wrote them while vLLM runs in the same process.

vLLM serves some architectures (GPT-NeoX/Pythia, OLMo, OLMo2, Phi, Starcoder2, GPTBigCode, GLM,
SmolLM3, ... : vLLM's "Transformers modeling backend") by building transformers' own decoder class
inside the engine. To make it compilable it decorates that class in place
(``vllm.compilation.decorators.support_torch_compile``): it appends a base class and replaces
``__init__`` and ``__call__``. In a hybrid worker the training engine builds the same class, so
after the rollout starts its model breaks: instances built before lack the attributes the new
``__call__`` reads (``'GPTNeoXModel' object has no attribute 'do_not_compile'``), and instances
built after would be set up for vLLM's compiler.

:func:`give_back_transformers_classes` undoes that once the engine is built: each class vLLM
decorated gets its own definition back, and vLLM's instances move to a subclass that carries the
decoration, so the engine still runs (and compiles, on GPU) exactly as vLLM set it up.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def _subclasses(cls: type) -> set[type]:
    found, todo = set(), [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def _decorated_classes(wrapper: type) -> set[type]:
    """transformers model classes (remote code too) that vLLM's compile decorator changed in place."""
    from torch import nn

    return {c for c in _subclasses(nn.Module) if wrapper in c.__bases__
            and c.__module__.startswith("transformers")}  # remote code: transformers_modules


def _original_init(cls: type):
    """The ``__init__`` the decorator replaced: its wrapper keeps it in a closure cell."""
    init = cls.__dict__.get("__init__")
    code = getattr(init, "__code__", None)
    if code is None or not init.__module__.startswith("vllm."):
        return None
    cells = dict(zip(code.co_freevars, init.__closure__ or ()))
    old = cells.get("old_init")
    return None if old is None else old.cell_contents


def undecorate(cls: type, wrapper: type, model) -> bool:
    """Give ``cls`` back its own definition; ``model``'s instances of it move to a private subclass
    that keeps vLLM's decoration. False (nothing changed) when the decoration is not the one this
    module knows."""
    old_init = _original_init(cls)
    if old_init is None:
        return False
    from vllm.compilation.decorators import IGNORE_COMPILE_KEY

    added = {name: value for name, value in vars(cls).items()
             if name in ("__init__", IGNORE_COMPILE_KEY) or getattr(value, "__module__", "").startswith("vllm.")}
    private = type(cls.__name__, (cls, wrapper), {**added, "__module__": cls.__module__,
                                                 "__qualname__": cls.__qualname__})
    for module in model.modules():
        if type(module) is cls:
            module.__class__ = private
    for name in added:
        delattr(cls, name)
    cls.__init__ = old_init
    cls.__bases__ = tuple(b for b in cls.__bases__ if b is not wrapper)
    return True


def restore_classes(worker) -> list[str]:
    """Runs inside vLLM's worker (via ``collective_rpc``) right after the engine is built: the
    names of the classes given back."""
    try:
        from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper as wrapper
    except ImportError:  # a vLLM without this decorator changes no class
        return []
    model = worker.model_runner.get_model()
    restored = []
    for cls in sorted(_decorated_classes(wrapper), key=lambda c: c.__qualname__):
        if undecorate(cls, wrapper, model):
            restored.append(cls.__qualname__)
        else:
            log.warning("vLLM changed transformers' %s in a way hybridflow does not know how to undo; "
                        "a training engine in this process that builds it may fail", cls.__qualname__)
    return restored


def give_back_transformers_classes(llm) -> list[str]:
    """Call right after ``LLM(...)``: every transformers class vLLM decorated while building the
    engine is given back (nothing happens for vLLM's own model code). Returns their names."""
    restored = llm.collective_rpc(restore_classes)[0]
    if restored:
        log.info("vLLM's Transformers backend: %s kept as transformers defines it for the training "
                 "engine", ", ".join(restored))
    return restored
