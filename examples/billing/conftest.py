"""The billing example's tests use kumiko's pytest fixtures: in your project, this line goes
in the root ``conftest.py``."""

pytest_plugins = ["kumiko_dramatiq.pytest_plugin"]
