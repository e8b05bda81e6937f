"""Example apps of our own, run on Dramatiq's ``RedisBroker`` and on kumiko's broker.

See :mod:`tests.compat.apps.__main__`.
"""
