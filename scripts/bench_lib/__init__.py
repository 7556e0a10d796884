"""Helpers of `scripts/bench.py`: workloads, random-weight models, hardware probes, roofline, systems, report."""
