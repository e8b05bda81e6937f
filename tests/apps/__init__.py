"""Small apps that tests run in worker subprocesses (``KUMIKO_APP=tests.apps.<mod>:registry``)."""
