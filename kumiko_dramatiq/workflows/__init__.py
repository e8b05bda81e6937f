"""Composing jobs: the results they return (:mod:`~kumiko_dramatiq.workflows.results`).

What a job's run hands on to whoever waits for it lives here, apart from the broker and the
middleware that run it: the worker's side only prepares what the settle call it makes anyway
writes (``lua/settle.lua``), and the reads (``runner.result``) are this package's own.
"""
