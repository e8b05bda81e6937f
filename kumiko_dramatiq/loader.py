"""Loading the app ``KUMIKO_APP`` names (the worker CLI, the scheduler and ``kumiko``).

``KUMIKO_APP`` is ``"package.module:attribute"``: a ``Registry``, which gets a runner built
from the ``KUMIKO_*`` variables, or a ``JobRunner``, which keeps its own settings; then every
``KUMIKO_*`` variable that is set must agree with them, or loading fails naming both values
(never silently ignored). Every problem is an :class:`~kumiko_dramatiq.errors.AppLoadError`
with a one-line message that says what to set.

Plain Dramatiq actors declared while the module is imported (``@dramatiq.actor`` in it, or in
a module it imports) bind to the app's kumiko broker, although that broker only exists once
the module has defined the app: during the import Dramatiq's global broker is an
:class:`ActorCollector`, which holds the actors (and any middleware added to the global
broker) and hands them over to the runner's broker (:meth:`ActorCollector.hand_over`). The
global broker is put back afterwards; ``dramatiq kumiko_dramatiq.app`` then makes the
runner's broker the global one.

Code that kept a reference to the global broker during the import (``broker =
dramatiq.get_broker()`` at module level, as Dramatiq's own examples do) holds the collector:
once it has handed over, the collector forwards every attribute to the runner's broker, so
``broker.enqueue(...)``, ``broker.join(...)``, ``broker.add_middleware(...)`` and the rest
reach the app's kumiko broker, as they reach the one global broker under plain Dramatiq. A
message sent through it before then (while the module is being imported, or after a load
that failed) is an :class:`~kumiko_dramatiq.errors.AppLoadError` saying which of the two.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import dramatiq
from dramatiq.broker import Broker
from dramatiq.message import Message

from kumiko_dramatiq.broker.seam import AnyActorOptions
from kumiko_dramatiq.environment import app_target, raw_value, variable_for, variable_values
from kumiko_dramatiq.errors import AppLoadError, KumikoError
from kumiko_dramatiq.registry import Registry
from kumiko_dramatiq.runner import JobRunner


def check_runner_agrees(runner: JobRunner, environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`AppLoadError` if a set ``KUMIKO_*`` variable disagrees with ``runner``."""
    for setting, value in variable_values(environ).items():
        own = getattr(runner.settings, setting)
        if own != value:
            variable = variable_for(setting)
            assert variable is not None
            raise AppLoadError(
                f"{variable}={raw_value(variable, environ)} disagrees with the JobRunner's "
                f"{setting}={own!r} (KUMIKO_APP={app_target(environ)}): unset {variable} "
                "or make them equal"
            )


#: The collector's own attributes: everything else is forwarded once it has handed over.
_COLLECTOR_OWN = frozenset({"hand_over", "import_done", "_target", "_app", "_importing"})


class ActorCollector(Broker):
    """Dramatiq's global broker while ``KUMIKO_APP``'s module is imported.

    Holds the actors declared on it and the middleware added to it until the app's kumiko
    broker exists, then :meth:`hand_over` binds them to that broker. Accepts any actor option
    (the middleware defining it may be added later in the module); the hand-over checks them
    against the kumiko broker's middleware, as ``dramatiq.actor`` would have.

    A reference to it kept past the import stays usable: after :meth:`hand_over`, every
    attribute but the collector's own (:data:`_COLLECTOR_OWN`, and dunder names) is read from,
    and written to, the kumiko broker, so the reference acts as that broker. Before it, a
    message sent through it is an :class:`AppLoadError` saying which case it is: while the
    module is imported there is no broker to send it to yet; after the import, the app failed
    to load (or is still being built).
    """

    _target: Broker | None
    _importing: bool

    def __init__(self, app: str) -> None:
        super().__init__(middleware=[])
        self.actor_options = AnyActorOptions()
        self.queues: dict[str, None] = {}
        self._app = app
        self._importing = True
        self._target = None

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("__") or name in _COLLECTOR_OWN:
            return object.__getattribute__(self, name)
        target = object.__getattribute__(self, "_target")
        if target is None:
            return object.__getattribute__(self, name)
        return getattr(target, name)

    def __setattr__(self, name: str, value: Any) -> None:
        target = self.__dict__.get("_target")
        if target is None or name.startswith("__") or name in _COLLECTOR_OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(target, name, value)

    def declare_queue(self, queue_name: str) -> None:
        self.queues[queue_name] = None

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        if self._importing:
            raise AppLoadError(
                f"KUMIKO_APP={self._app!r}: actor {message.actor_name!r} sent a message while "
                "the module was being imported, before the app's kumiko broker exists: send "
                "messages once the app is loaded, not at import"
            )
        raise AppLoadError(
            f"KUMIKO_APP={self._app!r}: actor {message.actor_name!r} sent a message through "
            "the global broker kept from the module's import, but the app is not loaded (it "
            "failed to load, or is still being built): there is no kumiko broker to send it to"
        )

    def import_done(self) -> None:
        """The module's import has ended (whether or not the app then loads)."""
        self._importing = False

    def hand_over(self, broker: Broker) -> None:
        """Add the collected middleware to ``broker``, bind the collected actors to it, and
        forward to it from now on."""
        target = self._app
        for middleware in self.middleware:
            broker.add_middleware(middleware)
        for actor in self.actors.values():
            undefined = set(actor.options) - broker.actor_options
            if undefined:
                raise AppLoadError(
                    f"KUMIKO_APP={target!r}: actor {actor.actor_name!r} has options no "
                    f"middleware of the kumiko broker defines: {', '.join(sorted(undefined))}"
                )
            if actor.actor_name in broker.actors:
                raise AppLoadError(
                    f"KUMIKO_APP={target!r}: actor {actor.actor_name!r} is declared twice "
                    "(a plain actor named like a kumiko job?)"
                )
            actor.broker = broker
            broker.declare_actor(actor)
        self._target = broker


def load_runner(environ: Mapping[str, str] | None = None) -> JobRunner:
    """The runner ``KUMIKO_APP`` names (it opens no connection)."""
    target = app_target(environ)
    if not target:
        raise AppLoadError(
            "KUMIKO_APP is not set: set it to 'package.module:attribute', "
            "naming a kumiko_dramatiq Registry or JobRunner"
        )
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise AppLoadError(
            f"KUMIKO_APP={target!r} must look like 'package.module:attribute' "
            "(a Registry or a JobRunner)"
        )
    collector = ActorCollector(target)
    previous = dramatiq.broker.global_broker
    dramatiq.set_broker(collector)
    try:
        module = importlib.import_module(module_name)
    except AppLoadError as exc:  # a message sent at import (ActorCollector.enqueue)
        raise AppLoadError(str(exc)) from None
    except ImportError as exc:
        raise AppLoadError(
            f"KUMIKO_APP={target!r}: cannot import module {module_name!r} ({exc}); "
            "check the name and that it is on PYTHONPATH"
        ) from None
    except Exception as exc:  # the app's own module failed: a syntax error, a raise, ...
        where = f" ({exc.filename}, line {exc.lineno})" if isinstance(exc, SyntaxError) else ""
        detail = " ".join(str(exc).split())
        raise AppLoadError(
            f"KUMIKO_APP={target!r}: importing module {module_name!r} raised "
            f"{type(exc).__name__}: {detail}{where}"
        ) from None
    finally:
        collector.import_done()
        dramatiq.broker.global_broker = previous
    runner = _runner_of(module, target, attribute, environ)
    collector.hand_over(runner.broker)
    return runner


def _runner_of(
    module: Any, target: str, attribute: str, environ: Mapping[str, str] | None
) -> JobRunner:
    module_name = module.__name__
    try:
        app = getattr(module, attribute)
    except AttributeError:
        raise AppLoadError(
            f"KUMIKO_APP={target!r}: module {module_name!r} has no attribute {attribute!r}"
        ) from None
    if isinstance(app, JobRunner):
        check_runner_agrees(app, environ)
        return app
    if not isinstance(app, Registry):
        raise AppLoadError(
            f"KUMIKO_APP={target!r} is a {type(app).__name__}, not a Registry or a JobRunner"
        )
    try:
        return JobRunner(app, **variable_values(environ))
    except KumikoError as exc:
        raise AppLoadError(f"KUMIKO_APP={target!r}: {exc}") from None
