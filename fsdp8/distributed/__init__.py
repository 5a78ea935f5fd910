"""The distributed foundation: process groups and device choice, meshes, collectives on streams,
the hang watchdog and the cross-rank checks that run before a collective could hang."""

from .check import DesyncError
from .mesh import data_parallel_mesh, make_mesh, tp_mesh
from .process_group import init_distributed

__all__ = ["DesyncError", "data_parallel_mesh", "init_distributed", "make_mesh", "tp_mesh"]
