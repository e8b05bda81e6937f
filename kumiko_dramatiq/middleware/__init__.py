"""Kumiko's Dramatiq middleware, one concern per module.

The chain (:func:`kumiko_dramatiq.runner.build_middleware`), in ``before_*``
order; ``after_*`` hooks run in reverse::

    Lane        consume only the runner's lane queue
    Boot        boot gates and boot-once jobs on process boot
    Executions  open/close the Execution of each delivery; dead-letter malformed messages
    Retries     retry failed attempts on the same message id (after: runs late)
    Sequential  the lease of sequential jobs (before: acquire or hand off; after: release)
    Dedup       the life of dedup keys
    Hooks       on_job_start / on_job_complete / on_job_failed
    TimeLimit   Dramatiq's, last so its timer covers only the handler
"""
