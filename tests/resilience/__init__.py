"""Failures at scale: injected faults, killed ranks, dead-rank detection, bounded stages."""
