"""Continuous batching: the planner decides a round, the executor runs it, the scheduler
takes requests and drives rounds; a static batch runs through the same executor."""
