"""The planner: memory, communication and speed of a training configuration, predicted from the
engine's own layout arithmetic (``plan``), and every configuration that fits ranked (``search``)."""

from .candidates import search
from .predict import plan

__all__ = ["plan", "search"]
