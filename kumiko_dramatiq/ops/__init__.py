"""Operating a dataset: admin queries and actions, run history reads, draining, the
``kumiko`` command and metrics exposition."""
