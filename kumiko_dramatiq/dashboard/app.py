"""The dashboard's ASGI app: :func:`create_app`.

Pages (GET, server-rendered, complete without JavaScript): ``/`` overview, ``/jobs``,
``/runs`` (and ``/runs/{message id}``), ``/dead``, ``/locks``, ``/dedup``, ``/schedules``,
``/boot``, ``/jobs/{job}`` (counts, waiting messages, hourly stats), ``/busy`` (what runs
now). Actions (POST, each from a form carrying the session's CSRF token):
``/actions/retry``, ``/actions/retry-all``, ``/actions/cancel``, ``/actions/pause``,
``/actions/resume``, ``/actions/purge``, ``/actions/delete``, ``/actions/run-now``,
``/actions/stop``, ``/actions/dispatch`` (a cron job run now, trigger manual); each
redirects back (303) with a one-line result shown once. Waiting messages' payloads are shown
only to a signed-in user (never on a read-only dashboard).

Access (see :mod:`kumiko_dramatiq.dashboard.security`):

- **no token**: read-only for everyone; no action is shown, every POST is refused (403);
- **a token**: every page needs a sign-in with the token (``/login``), which also allows the
  actions. So a dashboard reachable from the network shows nothing to whoever lacks it: the
  sign-in page (and any error page) shows no navigation, no Redis URL, no queue prefix and
  no version to someone not signed in. Sessions are kept in Redis (``keys.dashboard_session``)
  and signing out deletes them; sign-in attempts are limited per client address
  (``keys.dashboard_sign_ins``, a 429 beyond the limit).

Every template autoescapes (job names, tenant ids, errors and tracebacks come from user
code); responses carry a Content-Security-Policy that allows only the dashboard's own script
and stylesheet (``/static``, shipped in the package). Pages read through the runner's own
connection pool, in Starlette's thread pool; the app starts and stops nothing.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from importlib import metadata, resources
from typing import Any, Final
from urllib.parse import parse_qs, quote, urlencode

import jinja2
import redis
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.dashboard import pages
from kumiko_dramatiq.dashboard.pages import BadInput
from kumiko_dramatiq.dashboard.security import (
    SESSION_S,
    SIGN_IN_LIMIT,
    SIGN_IN_WINDOW_S,
    check_token,
    csrf_token,
    csrf_valid,
    new_session,
    session_digest,
    session_valid,
    token_matches,
)
from kumiko_dramatiq.environment import dashboard_token
from kumiko_dramatiq.errors import (
    JobConfigError,
    NotFoundError,
    PayloadError,
    RedisAccessError,
    RedisUnavailableError,
    UnknownJobError,
    redact_url,
)
from kumiko_dramatiq.runner import JobRunner

SESSION_COOKIE: Final = "kumiko-dashboard"
FLASH_COOKIE: Final = "kumiko-dashboard-flash"
#: The largest form body accepted.
MAX_FORM_BYTES: Final = 16 * 1024
#: (path, label) of the navigation, in order.
NAV: Final = (
    ("/", "Overview"),
    ("/jobs", "Jobs"),
    ("/busy", "Busy"),
    ("/runs", "Runs"),
    ("/dead", "Dead letters"),
    ("/batches", "Batches"),
    ("/locks", "Locks"),
    ("/dedup", "Dedup keys"),
    ("/schedules", "Schedules"),
    ("/boot", "Boot"),
)
STATIC: Final = {
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
HEADERS: Final = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "x-frame-options": "DENY",
}
#: Errors that are the request's fault: a 400 page, or a flash after an action.
INPUT_ERRORS: Final = (BadInput, JobConfigError, PayloadError, UnknownJobError, NotFoundError)
#: Where "back" may lead after an action: a path of this app (with a query).
_BACK: Final = re.compile(r"/(?![/\\])[^\s\\]*")


def create_app(runner: JobRunner, token: str | None = None) -> Starlette:
    """The dashboard of ``runner``'s dataset, as an ASGI app to serve (``kumiko dashboard``)
    or mount (``app.mount("/kumiko", create_app(runner))``).

    ``token`` enables actions (and then guards every page); ``None`` takes
    ``KUMIKO_DASHBOARD_TOKEN`` from the environment; with neither (or with ``token=""``)
    the dashboard is read-only. A token shorter than 16 characters is a ``JobConfigError``.
    The runner need not be started: the dashboard reads and acts through its admin API.
    """
    if not isinstance(runner, JobRunner):
        raise JobConfigError(None, "runner", "must be a JobRunner", type(runner).__name__)
    chosen = check_token(token, "token") if token is not None else dashboard_token()
    dashboard = Dashboard(runner, chosen)
    app = Starlette(
        routes=dashboard.routes(),
        exception_handlers={
            404: dashboard.not_found,
            405: dashboard.not_allowed,
            redis.RedisError: dashboard.redis_down,
            RedisUnavailableError: dashboard.redis_down,
            RedisAccessError: dashboard.redis_down,
        },
    )
    app.add_middleware(SecurityHeaders)
    return app


class SecurityHeaders:
    """Adds :data:`HEADERS` to every response (and ``no-store`` to every page)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                for name, value in HEADERS.items():
                    if name.encode() not in present:
                        headers.append((name.encode(), value.encode()))
                if b"cache-control" not in present:
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class Dashboard:
    """The state behind one app: the runner, the token, the templates and the assets."""

    def __init__(self, runner: JobRunner, token: str | None) -> None:
        self.runner = runner
        self.token = token
        self.version = _package_version()
        self.templates = jinja2.Environment(
            loader=jinja2.PackageLoader("kumiko_dramatiq.dashboard", "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.templates.filters.update(
            when=_when, ago=_ago, took=_took, short=_short, seg=_segment, pretty=_pretty
        )
        self.templates.globals.update(last_write=pages.last_write)
        folder = resources.files("kumiko_dramatiq.dashboard") / "static"
        self.assets = {name: (folder / name).read_bytes() for name in STATIC}
        self.dataset = f"{redact_url(runner.redis_url)} · prefix {runner.queue_prefix}"

    def routes(self) -> list[Route]:
        view = self._view
        return [
            Route("/", view("overview.html", lambda r: pages.overview(self.runner, _now()))),
            Route("/jobs", view("jobs.html", lambda r: pages.jobs(self.runner))),
            Route(
                "/jobs/{name}",
                view(
                    "job.html",
                    lambda r: pages.job(self.runner, r.path_params["name"], _query(r), _now()),
                ),
            ),
            Route("/busy", view("busy.html", lambda r: pages.busy(self.runner))),
            Route("/runs", view("runs.html", lambda r: pages.runs(self.runner, _query(r)))),
            Route(
                "/runs/{message_id}",
                view("run.html", lambda r: pages.run(self.runner, r.path_params["message_id"])),
            ),
            Route("/dead", view("dead.html", lambda r: pages.dead(self.runner, _query(r)))),
            Route(
                "/batches", view("batches.html", lambda r: pages.batches(self.runner, _query(r)))
            ),
            Route(
                "/batches/{batch_id}",
                view("batch.html", lambda r: pages.batch(self.runner, r.path_params["batch_id"])),
            ),
            Route("/locks", view("locks.html", lambda r: pages.locks(self.runner))),
            Route("/dedup", view("dedup.html", lambda r: pages.dedup(self.runner, _query(r)))),
            Route(
                "/schedules", view("schedules.html", lambda r: pages.schedules(self.runner, _now()))
            ),
            Route("/boot", view("boot.html", lambda r: pages.boot(self.runner))),
            Route("/login", self.login_page, methods=["GET"]),
            Route("/login", self.login, methods=["POST"]),
            Route("/logout", self.logout, methods=["POST"]),
            Route("/actions/{name}", self.action, methods=["POST"]),
            Route("/static/{name}", self.static, methods=["GET"]),
        ]

    # -- rendering -----------------------------------------------------------------------
    def page(
        self,
        request: Request,
        template: str,
        status_code: int = 200,
        *,
        session: str | None = None,
        **context: Any,
    ) -> HTMLResponse:
        """Render ``template`` for ``session`` (the request's, read by the caller; ``None``:
        not signed in). Someone not signed in to a dashboard with a token sees no
        navigation, dataset, version or flash."""
        base = _base(request)
        exposed = self.token is None or session is not None
        flash = _read_flash(request)
        path = "/" + request.url.path[len(base) :].lstrip("/")
        html = self.templates.get_template(template).render(
            base=base,
            url=lambda target, **query: _url(base, target, query),
            nav=NAV if exposed else (),
            path=path,
            current="/" + path.split("/")[1] if path != "/" else "/",
            read_only=self.token is None,
            signed_in=session is not None,
            can_act=session is not None,
            csrf="" if session is None or self.token is None else csrf_token(self.token, session),
            back=path + (f"?{request.url.query}" if request.url.query else ""),
            dataset=self.dataset if exposed else "",
            version=self.version if exposed else "",
            flash=flash if exposed else None,
            now=_now(),
            problems=self._problems() if exposed else [],
            **context,
        )
        response = HTMLResponse(html, status_code)
        if flash is not None:
            response.delete_cookie(FLASH_COOKIE, path=_cookie_path(request))
        return response

    def _problems(self) -> list[str]:
        """The dataset's problems for the banner of every page (``runner.status()``'s);
        when Redis does not answer, that is the one problem."""
        try:
            return self.runner.admin.current_problems()
        except redis.RedisError as exc:
            return [f"Redis does not answer: {' '.join(str(exc).split())[:200]}"]

    def _view(
        self, template: str, build: Callable[[Request], dict[str, Any]]
    ) -> Callable[[Request], Response]:
        """A page endpoint (plain function: Starlette runs it in its thread pool)."""

        def endpoint(request: Request) -> Response:
            session = self._session(request)
            if self.token is not None and session is None:
                target = request.url.path[len(_base(request)) :] or "/"
                if request.url.query:
                    target += "?" + request.url.query
                return RedirectResponse(
                    _url(_base(request), "/login", {"next": target}), status_code=303
                )
            try:
                context = build(request)
            except INPUT_ERRORS as exc:
                return self.page(
                    request,
                    "error.html",
                    400,
                    session=session,
                    title="Bad request",
                    error=str(exc),
                )
            return self.page(request, template, session=session, **context)

        return endpoint

    # -- sign-in -------------------------------------------------------------------------
    def _signed(self, request: Request) -> str | None:
        """The request's session cookie if it is well signed and young enough (no Redis)."""
        if self.token is None:
            return None
        value = request.cookies.get(SESSION_COOKIE)
        return value if session_valid(self.token, value, int(time.time())) else None

    def _session(self, request: Request) -> str | None:
        """The request's session: a well-signed cookie whose session is still stored (one
        ``GET``; blocking, so async endpoints call it in the thread pool)."""
        value = self._signed(request)
        if value is None:
            return None
        stored = self.runner.broker.client.get(self._session_key(value))
        return value if stored is not None else None

    def _session_key(self, value: str) -> str:
        return keys.dashboard_session(self.runner.queue_prefix, session_digest(value))

    def login_page(self, request: Request) -> Response:
        return self.page(
            request,
            "login.html",
            session=self._session(request),
            next=_safe_back(request.query_params.get("next")),
        )

    async def login(self, request: Request) -> Response:
        form = await _form(request)
        target = _safe_back(form.get("next"))
        if self.token is None:
            return self.page(request, "login.html", 403, next=target)
        address = request.client.host if request.client is not None else "unknown"
        attempts = await run_in_threadpool(self._count_sign_in, address)
        if attempts > SIGN_IN_LIMIT:
            minutes = max(1, SIGN_IN_WINDOW_S // 60)
            return self.page(
                request,
                "login.html",
                429,
                next=target,
                error=f"Too many sign-in attempts from your address: try again in {minutes} "
                "minutes.",
            )
        if not token_matches(self.token, form.get("token", "")):
            return self.page(request, "login.html", 403, next=target, error="Wrong token.")
        session = new_session(self.token, int(time.time()))
        await run_in_threadpool(
            self.runner.broker.client.set, self._session_key(session), "1", px=SESSION_S * 1000
        )
        response = RedirectResponse(_base(request) + target, status_code=303)
        response.set_cookie(
            SESSION_COOKIE,
            session,
            max_age=SESSION_S,
            path=_cookie_path(request),
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return response

    def _count_sign_in(self, address: str) -> int:
        """Count one sign-in attempt of ``address`` in the current window; the count."""
        return int(
            self.runner.broker.lua.count_attempt(
                keys=[keys.dashboard_sign_ins(self.runner.queue_prefix, address)],
                args=[SIGN_IN_WINDOW_S * 1000],
            )
        )

    async def logout(self, request: Request) -> Response:
        form = await _form(request)
        session = await run_in_threadpool(self._session, request)
        refusal = self._refusal(session, form)
        if refusal is not None:
            return self.page(
                request, "error.html", 403, session=session, title="Refused", error=refusal
            )
        assert session is not None
        await run_in_threadpool(self.runner.broker.client.delete, self._session_key(session))
        response = RedirectResponse(_base(request) + "/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path=_cookie_path(request))
        return response

    def _refusal(self, session: str | None, form: Mapping[str, str]) -> str | None:
        """Why an action POST of ``session`` is refused (``None``: allowed)."""
        if self.token is None:
            return (
                "This dashboard is read-only: start it with KUMIKO_DASHBOARD_TOKEN set "
                "(or create_app(runner, token=...)) to act on messages and jobs."
            )
        if session is None:
            return "Sign in with the dashboard token first."
        if not csrf_valid(self.token, session, form.get("csrf")):
            return "The form's CSRF token is missing or stale: reload the page and try again."
        return None

    # -- actions -------------------------------------------------------------------------
    async def action(self, request: Request) -> Response:
        handler = _ACTIONS.get(request.path_params["name"])
        if handler is None:
            return await self.not_found(request, None)
        form = await _form(request)
        session = await run_in_threadpool(self._session, request)
        refusal = self._refusal(session, form)
        if refusal is not None:
            return self.page(
                request, "error.html", 403, session=session, title="Refused", error=refusal
            )
        try:
            flash = await run_in_threadpool(handler, self.runner, form)
        except INPUT_ERRORS as exc:
            flash = {"kind": "error", "text": str(exc)}
        response = RedirectResponse(_base(request) + _safe_back(form.get("back")), status_code=303)
        response.set_cookie(
            FLASH_COOKIE,
            base64.urlsafe_b64encode(json.dumps(flash).encode()).decode(),
            max_age=60,
            path=_cookie_path(request),
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return response

    # -- assets and errors ---------------------------------------------------------------
    def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in self.assets:
            return Response("not found", 404, media_type="text/plain")
        return Response(
            self.assets[name],
            media_type=STATIC[name],
            headers={"cache-control": "public, max-age=3600"},
        )

    async def not_found(self, request: Request, exc: Exception | None) -> Response:
        session = await run_in_threadpool(self._session, request)
        return self.page(
            request, "error.html", 404, session=session, title="Not found", error="No such page."
        )

    async def not_allowed(self, request: Request, exc: Exception) -> Response:
        session = await run_in_threadpool(self._session, request)
        return self.page(
            request,
            "error.html",
            405,
            session=session,
            title="Not allowed",
            error="Method not allowed here.",
        )

    async def redis_down(self, request: Request, exc: Exception) -> Response:
        # no session can be read: a well-signed cookie is taken as signed in, anyone else
        # learns nothing about the deployment
        session = self._signed(request)
        if self.token is not None and session is None:
            error = "The dashboard cannot reach its data right now: try again later."
        elif isinstance(exc, RedisUnavailableError | RedisAccessError):
            error = str(exc)
        else:
            error = f"Redis at {redact_url(self.runner.redis_url)} failed: {exc}"
        return self.page(
            request, "error.html", 503, session=session, title="Redis unavailable", error=error
        )


# -- actions (run in the thread pool; return the flash) --------------------------------------
Flash = dict[str, str]


def _retry(runner: JobRunner, form: Mapping[str, str]) -> Flash:
    message_id = pages.parse_message_id(form.get("message_id"))
    new_id = runner.retry_dead(message_id)
    if new_id is False:
        return {"kind": "error", "text": f"Message {message_id} is not a dead letter."}
    return {
        "kind": "ok",
        "text": f"Dead letter {message_id} re-enqueued: it runs again as {new_id}.",
        "link": f"/runs/{new_id}",
    }


def _retry_all(runner: JobRunner, form: Mapping[str, str]) -> Flash:
    job = pages.parse_job(runner, form)
    if job is None:
        raise BadInput("retry all needs a job")
    retried = runner.admin.retry_all_dead(job)
    if not retried:
        raise NotFoundError(f"job {job} has no dead letter to retry")
    return {"kind": "ok", "text": f"{len(retried)} dead letter(s) of {job} re-enqueued."}


def _cancel(runner: JobRunner, form: Mapping[str, str]) -> Flash:
    message_id = pages.parse_message_id(form.get("message_id"))
    if runner.cancel(message_id):
        return {"kind": "ok", "text": f"Message {message_id} cancelled: it will not start."}
    return {
        "kind": "error",
        "text": f"Message {message_id} is running: not interrupted, nothing changed.",
    }


def _cancel_batch(runner: JobRunner, form: Mapping[str, str]) -> Flash:
    batch_id = pages.parse_message_id(form.get("batch_id"))
    never = runner.cancel_batch(batch_id)
    return {
        "kind": "ok",
        "text": f"Batch {batch_id} cancelled: {never} children will never start.",
        "link": f"/batches/{batch_id}",
    }


def _pause(runner: JobRunner, form: Mapping[str, str]) -> Flash:
    job = pages.parse_job(runner, form)
    if job is None:
        raise BadInput("pause needs a job")
    changed = runner.admin.pause(runner.job(job))
    return {"kind": "ok", "text": f"{job} paused." if changed else f"{job} was paused already."}


def _resume(runner: JobRunner, form: Mapping[str, str]) -> Flash:
    job = pages.parse_job(runner, form)
    if job is None:
        raise BadInput("resume needs a job")
    outcome = runner.admin.resume(runner.job(job))
    if outcome is None:
        raise NotFoundError(f"job {job} is not paused")
    requeued, dropped = outcome
    return {
        "kind": "ok",
        "text": f"{job} resumed: {requeued} held-back message(s) queued, {dropped} skipped.",
    }


def _purge(runner: JobRunner, form: Mapping[str, str]) -> Flash:
    job = pages.parse_job(runner, form)
    if job is None:
        raise BadInput("purge needs a job")
    state = form.get("state", "queued")
    if state not in ("queued", "delayed", "parked", "dead"):
        raise BadInput(f"state must be one of queued, delayed, parked, dead, got {state!r}")
    removed = runner.purge(job, state=state)
    return {"kind": "ok", "text": f"{removed} {state} message(s) of {job} removed."}


def _delete(runner: JobRunner, form: Mapping[str, str]) -> Flash:
    message_id = pages.parse_message_id(form.get("message_id"))
    if runner.delete_dead(message_id):
        return {"kind": "ok", "text": f"Dead letter {message_id} deleted."}
    return {"kind": "error", "text": f"Message {message_id} is not a dead letter, nothing changed."}


def _run_now(runner: JobRunner, form: Mapping[str, str]) -> Flash:
    message_id = pages.parse_message_id(form.get("message_id"))
    if runner.run_now(message_id):
        return {"kind": "ok", "text": f"Message {message_id} queued now."}
    return {"kind": "error", "text": f"Message {message_id} is not delayed, nothing changed."}


def _stop(runner: JobRunner, form: Mapping[str, str]) -> Flash:
    message_id = pages.parse_message_id(form.get("message_id"))
    if runner.stop_run(message_id):
        return {
            "kind": "ok",
            "text": f"Stop requested for {message_id}: it ends cancelled within a second.",
            "link": f"/runs/{message_id}",
        }
    return {"kind": "error", "text": f"Message {message_id} is not running, nothing changed."}


def _dispatch_now(runner: JobRunner, form: Mapping[str, str]) -> Flash:
    job = pages.parse_job(runner, form)
    if job is None:
        raise BadInput("run now needs a job")
    message_id = runner.dispatch(job)
    return {
        "kind": "ok",
        "text": f"{job} dispatched now (trigger manual) as {message_id}.",
        "link": f"/runs/{message_id}",
    }


def _schedule_id(form: Mapping[str, str]) -> str:
    schedule_id = form.get("schedule", "")
    if not schedule_id:
        raise BadInput("a schedule action needs a schedule")
    return schedule_id


def _schedule_pause(runner: JobRunner, form: Mapping[str, str]) -> Flash:
    schedule_id = _schedule_id(form)
    if runner.schedules.pause(schedule_id):
        return {"kind": "ok", "text": f"Schedule {schedule_id} paused: no tick fires now."}
    return {"kind": "error", "text": f"Schedule {schedule_id} is unknown or paused already."}


def _schedule_resume(runner: JobRunner, form: Mapping[str, str]) -> Flash:
    schedule_id = _schedule_id(form)
    if runner.schedules.resume(schedule_id):
        return {"kind": "ok", "text": f"Schedule {schedule_id} resumed."}
    return {"kind": "error", "text": f"Schedule {schedule_id} is unknown or not paused."}


def _schedule_trigger(runner: JobRunner, form: Mapping[str, str]) -> Flash:
    schedule_id = _schedule_id(form)
    try:
        message_id = runner.schedules.trigger(schedule_id)
    except NotFoundError:
        return {"kind": "error", "text": f"No schedule {schedule_id}."}
    return {
        "kind": "ok",
        "text": f"Schedule {schedule_id} triggered: one run now as {message_id}.",
        "link": f"/runs/{message_id}",
    }


_ACTIONS: Final[dict[str, Callable[[JobRunner, Mapping[str, str]], Flash]]] = {
    "purge": _purge,
    "delete": _delete,
    "run-now": _run_now,
    "stop": _stop,
    "dispatch": _dispatch_now,
    "retry": _retry,
    "retry-all": _retry_all,
    "cancel": _cancel,
    "cancel-batch": _cancel_batch,
    "pause": _pause,
    "resume": _resume,
    "schedule-pause": _schedule_pause,
    "schedule-resume": _schedule_resume,
    "schedule-trigger": _schedule_trigger,
}


# -- helpers -----------------------------------------------------------------------------------
def _now() -> datetime:
    return datetime.now(UTC)


def _base(request: Request) -> str:
    """The path the app is mounted at ("" at the root)."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def _cookie_path(request: Request) -> str:
    return _base(request) or "/"


def _query(request: Request) -> dict[str, str]:
    return dict(request.query_params)


def _url(base: str, target: str, query: Mapping[str, Any] | None = None) -> str:
    """``base + target`` with ``query`` (empty values left out)."""
    pairs = {k: str(v) for k, v in (query or {}).items() if v not in (None, "")}
    return base + target + ("?" + urlencode(pairs) if pairs else "")


def _safe_back(value: str | None) -> str:
    """``value`` if it is a path of this app, else ``/`` (never another site)."""
    return value if value is not None and _BACK.fullmatch(value) else "/"


async def _form(request: Request) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body (the only kind the forms send), parsed
    with the standard library: no multipart parser needed."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        return {}
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return {}
    try:
        fields = parse_qs(body.decode(), keep_blank_values=True, max_num_fields=20)
    except (UnicodeDecodeError, ValueError):
        return {}
    return {name: values[0] for name, values in fields.items()}


def _read_flash(request: Request) -> Flash | None:
    raw = request.cookies.get(FLASH_COOKIE)
    if not raw:
        return None
    try:
        value = json.loads(base64.urlsafe_b64decode(raw.encode()))
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    flash = {k: str(v) for k, v in value.items() if k in ("kind", "text", "link")}
    if "link" in flash and not _BACK.fullmatch(flash["link"]):
        del flash["link"]
    return flash if "text" in flash else None


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _ago(value: datetime | None) -> str:
    if value is None:
        return "-"
    seconds = (_now() - value).total_seconds()
    future = seconds < 0
    seconds = abs(seconds)
    if seconds < 60:
        text = f"{seconds:.0f} s"
    elif seconds < 3600:
        text = f"{seconds / 60:.0f} min"
    elif seconds < 86_400:
        text = f"{seconds / 3600:.1f} h"
    else:
        text = f"{seconds / 86_400:.1f} d"
    return f"in {text}" if future else f"{text} ago"


def _took(ms: int | None) -> str:
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    return f"{ms / 60_000:.1f} min"


def _pretty(value: Any) -> str:
    """A payload as indented JSON (autoescaped by the template)."""
    return json.dumps(value, indent=2, sort_keys=True, default=str)


def _segment(value: str) -> str:
    """``value`` quoted as one path segment."""
    return quote(str(value), safe="")


def _short(value: str | None, chars: int = 8) -> str:
    return "-" if not value else value[:chars]


def _package_version() -> str:
    try:
        return metadata.version("kumiko_dramatiq")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"
