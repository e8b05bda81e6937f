"""The example's tests use kumiko's pytest fixtures (a real Redis, a dataset per test)."""

pytest_plugins = ["kumiko_dramatiq.pytest_plugin"]
