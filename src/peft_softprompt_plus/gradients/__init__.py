"""Gradient flow: the probe run when an adapter is attached, the checks that name a cause, the report and the
Trainer callback."""
