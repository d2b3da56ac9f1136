"""The single controller's view of the cluster: resource pools, worker groups, dispatch modes."""
from hybridflow.controller.colocate import create_colocated_worker_cls
from hybridflow.controller.dispatch import Dispatch, DispatchMode, Execute, register
from hybridflow.controller.future import DataProtoFuture, GroupFuture
from hybridflow.controller.resource_pool import ResourceError, ResourcePool
from hybridflow.controller.worker import Worker
from hybridflow.controller.worker_group import (RayClassWithInitArgs, RayWorkerGroup, WorkerGroupError,
                                               WorkerMemoryError)

__all__ = [
    "Dispatch", "DispatchMode", "Execute", "register", "Worker", "ResourcePool", "ResourceError",
    "RayClassWithInitArgs", "RayWorkerGroup", "WorkerGroupError", "WorkerMemoryError",
    "create_colocated_worker_cls", "DataProtoFuture", "GroupFuture",
]
