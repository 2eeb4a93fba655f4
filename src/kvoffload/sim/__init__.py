"""Trace replay and capacity planning: traces, synthetic workloads, replay through a tier."""
