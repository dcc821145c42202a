"""Fully sharded training: communication units, their module hooks and their life cycle."""

from .unit import State, Unit

__all__ = ["State", "Unit"]
