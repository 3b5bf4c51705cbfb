"""Scheduling policies: interchangeable implementations of ``SchedulingPolicy``."""
