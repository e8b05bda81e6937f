"""What runs inside a worker process: the runtime, the actors, fan-out, the event loop."""
