"""The cron scheduler sidecar (lands with its own change)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runner import JobRunner


class Scheduler:
    def __init__(self, runner: JobRunner) -> None:
        self.runner = runner

    def start(self) -> None:
        raise NotImplementedError("the cron scheduler lands with its own change")

    def stop(self) -> None:
        pass


def main() -> int:
    raise SystemExit("kumiko-scheduler: not implemented yet")


if __name__ == "__main__":
    main()
