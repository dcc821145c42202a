"""Fully sharded training: communication units, their module hooks and their life cycle."""

from .reduced_grad import ReducedGrad
from .unit import State, Unit

__all__ = ["ReducedGrad", "State", "Unit"]
