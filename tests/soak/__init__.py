"""The soak: a real deployment under faults (``python -m tests.soak.run --short``)."""
