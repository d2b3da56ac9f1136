"""Host several roles (actor, rollout, ref, critic, ...) in one process per slot.

Colocating in one process lets the roles share the device and the torch.distributed world
(the hybrid engine). The generated class forwards ``{role}__{method}`` to the role's own instance;
``RayWorkerGroup.spawn(roles)`` then gives one WorkerGroup view per role, so the trainer addresses
each role as if it had its own group.
"""
from __future__ import annotations

from hybridflow.controller.dispatch import MAGIC_ATTR, registered_methods
from hybridflow.controller.worker import Worker
from hybridflow.controller.worker_group import RayClassWithInitArgs


def _forward(role: str, method: str, spec: dict | None):
    def call(self, *args, **kwargs):
        return getattr(self._roles[role], method)(*args, **kwargs)

    call.__name__ = f"{role}__{method}"
    if spec is not None:
        setattr(call, MAGIC_ATTR, spec)
    return call


def create_colocated_worker_cls(role_classes: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """One worker class hosting every role of ``role_classes`` (role name -> class with init args)."""
    for role in role_classes:
        if "__" in role or not role.isidentifier():
            raise ValueError(f"colocated role name {role!r} must be an identifier without '__'")
    init_args = {role: (c.cls, c.args, c.kwargs) for role, c in role_classes.items()}

    def __init__(self, roles=init_args):
        Worker.__init__(self)
        self._roles = {role: cls(*args, **kwargs) for role, (cls, args, kwargs) in roles.items()}
        for instance in self._roles.values():  # each role may reach its siblings (the fused PPO update)
            instance._colocated_roles = self._roles

    namespace = {"__init__": __init__}
    for role, c in role_classes.items():
        for method, spec in registered_methods(c.cls).items():
            namespace[f"{role}__{method}"] = _forward(role, method, spec)
        namespace[f"{role}___hf_mesh"] = _forward(role, "_hf_mesh", None)
    name = "Colocated_" + "_".join(role_classes)
    return RayClassWithInitArgs(type(name, (Worker,), namespace))
