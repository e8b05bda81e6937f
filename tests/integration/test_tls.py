"""TLS (``rediss://``) against a private ``redis-server --tls-port`` with certificates made by
``openssl`` for the test: workers (in-process and ``dramatiq kumiko_dramatiq.app``), the
scheduler, the ``kumiko`` command and the dashboard all connect; a wrong CA, a missing client
certificate is one clear line at start, without waiting out the timeout."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import pytest
from starlette.testclient import TestClient

from kumiko_dramatiq import JobConfigError, JobRunner, KumikoError
from kumiko_dramatiq.dashboard import create_app
from kumiko_dramatiq.errors import RedisAccessError
from tests.conftest import wait_for
from tests.deployment import (
    BOOT,
    FAN,
    ROOT,
    TICK,
    WORK,
    Certificates,
    Server,
    cli_env,
    kumiko,
    main_paths_registry,
    make_certificates,
    run_main_paths,
    start_server,
    start_tls_server,
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, certs: Certificates) -> Iterator[Server]:
    """A TLS-only redis-server that requires client certificates signed by the test CA."""
    server = start_tls_server(tmp_path_factory.mktemp("tls"), certs, auth_clients=True)
    yield server
    server.stop()


def tls_url(server: Server, certs: Certificates, **overrides: str | None) -> str:
    options: dict[str, str | None] = {
        "ssl_ca_certs": str(certs.ca),
        "ssl_certfile": str(certs.client_cert),
        "ssl_keyfile": str(certs.client_key),
        **overrides,
    }
    query = urlencode({k: v for k, v in options.items() if v is not None})
    return f"rediss://127.0.0.1:{server.port}/0?{query}"


def one_line(text: str) -> list[str]:
    """The lines of a subprocess's stderr that kumiko wrote (its one-line errors)."""
    return [
        line
        for line in text.splitlines()
        if line.startswith(("kumiko", "Redis at")) or ("CRITICAL" in line and "kumiko" in line)
    ]


def test_a_worker_with_a_scheduler_runs_every_main_path_over_tls(
    tls_server: Server, certs: Certificates, prefix: str
) -> None:
    seen = run_main_paths(tls_url(tls_server, certs), prefix)
    assert seen.completed[WORK] == 4
    assert seen.completed[BOOT] == 1
    assert seen.completed[FAN] == 3
    assert seen.completed[TICK] >= 1


def test_the_kumiko_command_and_the_dashboard_connect_over_tls(
    tls_server: Server, certs: Certificates, prefix: str
) -> None:
    url = tls_url(tls_server, certs)
    done = kumiko(cli_env(url, prefix), "status")
    assert done.returncode == 0, done.stderr
    assert "worker" in done.stdout

    runner = JobRunner(main_paths_registry(), redis_url=url, queue_prefix=prefix)
    try:
        page = TestClient(create_app(runner)).get("/")
        assert page.status_code == 200
        assert "worker lane" in page.text
    finally:
        runner.stop()


@pytest.mark.slow
def test_a_cli_worker_runs_a_job_over_tls(
    tls_server: Server, certs: Certificates, prefix: str, tmp_path: Path
) -> None:
    # Given `dramatiq kumiko_dramatiq.app` on a rediss:// URL (its own process)
    url = tls_url(tls_server, certs)
    producer = JobRunner(main_paths_registry(), redis_url=url, queue_prefix=prefix)
    env = cli_env(url, prefix)
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "2"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # When a job is dispatched, Then the CLI worker runs it to completion
        message_id = producer.dispatch(WORK, {})
        wait_for(
            lambda: [r.status for r in producer.run_record(message_id)] == ["completed"],
            timeout_s=30,
            what=f"the CLI worker's run (log: {tmp_path / 'worker.log'})",
        )
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        log.close()
        producer.stop()


# -- one clear line at start ----------------------------------------------------------------
def test_a_wrong_ca_fails_start_at_once_in_one_line(
    tls_server: Server, certs: Certificates, prefix: str
) -> None:
    url = tls_url(tls_server, certs, ssl_ca_certs=str(certs.wrong_ca))
    runner = JobRunner(
        main_paths_registry(),
        redis_url=url,
        queue_prefix=prefix,
        boot_redis_timeout_ms=60_000,
        get_active_tenant_ids=list,
    )
    began = time.monotonic()
    with pytest.raises(RedisAccessError) as caught:
        runner.start()
    runner.stop()
    message = str(caught.value)
    assert "\n" not in message
    assert "does not verify" in message
    assert "ssl_ca_certs" in message
    # at once: not after the 60 s boot_redis_timeout_ms (a retry cannot cure a wrong CA)
    assert time.monotonic() - began < 30


@pytest.mark.parametrize(
    ("command", "status"),
    [("kumiko", 1), ("scheduler", 1), pytest.param("worker", 3, marks=pytest.mark.slow)],
)
def test_a_wrong_ca_is_one_line_for_every_command(
    command: str, status: int, tls_server: Server, certs: Certificates, prefix: str
) -> None:
    url = tls_url(tls_server, certs, ssl_ca_certs=str(certs.wrong_ca))
    argv = {
        "kumiko": [sys.executable, "-m", "kumiko_dramatiq.ops.cli", "status"],
        "scheduler": [sys.executable, "-m", "kumiko_dramatiq.scheduler"],
        "worker": [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "1"],
    }[command]
    done = subprocess.run(
        argv, cwd=ROOT, env=cli_env(url, prefix), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == status, done.stderr
    lines = one_line(done.stderr)
    assert len(lines) == 1, done.stderr
    assert "does not verify" in lines[0]
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_cli_worker_without_the_client_certificate_fails_in_one_line(
    tls_server: Server, certs: Certificates, prefix: str
) -> None:
    url = tls_url(tls_server, certs, ssl_certfile=None, ssl_keyfile=None)
    done = subprocess.run(
        [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "1"],
        cwd=ROOT,
        env=cli_env(url, prefix),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    lines = one_line(done.stderr)
    assert len(lines) == 1, done.stderr
    assert "client certificate" in lines[0]


def test_a_missing_client_certificate_fails_start_in_one_line(
    tls_server: Server, certs: Certificates, prefix: str
) -> None:
    url = tls_url(tls_server, certs, ssl_certfile=None, ssl_keyfile=None)
    runner = JobRunner(main_paths_registry(), redis_url=url, queue_prefix=prefix)
    with pytest.raises(RedisAccessError, match="client certificate") as caught:
        runner.check_redis()
    runner.stop()
    assert "\n" not in str(caught.value)


def _encrypted_key(certs: Certificates) -> Path:
    encrypted = certs.client_key.with_name("client-encrypted.key")
    if not encrypted.exists():
        subprocess.run(
            [
                *("openssl", "pkey", "-in", str(certs.client_key), "-aes256"),
                *("-passout", "pass:secret", "-out", str(encrypted)),
            ],
            check=True,
            capture_output=True,
        )
    return encrypted


def test_an_encrypted_client_key_is_refused_when_the_runner_is_built_without_a_prompt(
    tls_server: Server, certs: Certificates, prefix: str
) -> None:
    url = tls_url(tls_server, certs, ssl_keyfile=str(_encrypted_key(certs)))
    with pytest.raises(JobConfigError, match="encrypted private key") as caught:
        JobRunner(main_paths_registry(), redis_url=url, queue_prefix=prefix)
    assert "\n" not in str(caught.value)
    assert "ssl_keyfile" in str(caught.value)


def test_an_encrypted_client_key_is_one_line_without_a_terminal_too(
    tls_server: Server, certs: Certificates, prefix: str
) -> None:
    # no terminal: no stdin, a session of its own (OpenSSL's prompt would repeat or hang)
    url = tls_url(tls_server, certs, ssl_keyfile=str(_encrypted_key(certs)))
    done = subprocess.run(
        [sys.executable, "-m", "kumiko_dramatiq.ops.cli", "status"],
        cwd=ROOT,
        env=cli_env(url, prefix),
        capture_output=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "PEM pass phrase" not in done.stderr + done.stdout
    [line] = done.stderr.strip().splitlines()
    assert "encrypted private key" in line


def test_a_plain_url_on_the_tls_port_says_to_use_rediss(
    tls_server: Server, certs: Certificates, prefix: str
) -> None:
    runner = JobRunner(
        main_paths_registry(),
        redis_url=f"redis://127.0.0.1:{tls_server.port}/0",
        queue_prefix=prefix,
        boot_redis_timeout_ms=2_000,
    )
    with pytest.raises(
        RedisAccessError, match="speaks TLS on this port: use a rediss://"
    ) as caught:
        runner.check_redis()
    runner.stop()
    assert "\n" not in str(caught.value)


def test_a_tls_url_on_a_plain_port_says_to_use_redis(
    certs: Certificates, prefix: str, tmp_path: Path
) -> None:
    plain = start_server("plain", tmp_path)
    try:
        url = f"rediss://127.0.0.1:{plain.port}/0?{urlencode({'ssl_ca_certs': str(certs.ca)})}"
        runner = JobRunner(
            main_paths_registry(), redis_url=url, queue_prefix=prefix, boot_redis_timeout_ms=1_000
        )
        with pytest.raises(RedisAccessError, match="without TLS on this port") as caught:
            runner.check_redis()
        runner.stop()
        assert "use a redis:// URL" in str(caught.value)
        assert "\n" not in str(caught.value)
    finally:
        plain.stop()


def test_ssl_cert_reqs_optional_verifies_the_server_as_required_does(
    tls_server: Server, certs: Certificates, prefix: str
) -> None:
    # as documented: Python's ssl verifies a server's certificate whenever it asks for one
    url = tls_url(tls_server, certs, ssl_ca_certs=str(certs.wrong_ca), ssl_cert_reqs="optional")
    runner = JobRunner(main_paths_registry(), redis_url=url, queue_prefix=prefix)
    with pytest.raises(RedisAccessError, match="does not verify"):
        runner.check_redis()
    runner.stop()


def test_an_async_producer_dispatches_over_tls_with_a_client_certificate(
    tls_server: Server, certs: Certificates, prefix: str
) -> None:
    runner = JobRunner(
        main_paths_registry(), redis_url=tls_url(tls_server, certs), queue_prefix=prefix
    )

    async def produce() -> str:
        mid = await runner.adispatch(WORK, {"n": 1})
        await runner.aclose()
        return mid

    with runner:
        mid = asyncio.run(produce())
        assert runner.job_state(mid) == "queued"


def test_a_wrong_ca_fails_an_async_dispatch_as_it_fails_a_sync_one(
    tls_server: Server, certs: Certificates, prefix: str
) -> None:
    url = tls_url(tls_server, certs, ssl_ca_certs=str(certs.wrong_ca))
    runner = JobRunner(main_paths_registry(), redis_url=url, queue_prefix=prefix)
    with runner:
        with pytest.raises(KumikoError) as sync_error:
            runner.dispatch(WORK, {})

        async def produce() -> None:
            await runner.adispatch(WORK, {})

        with pytest.raises(KumikoError) as async_error:
            asyncio.run(produce())
    assert type(async_error.value) is type(sync_error.value)
    assert str(async_error.value) == str(sync_error.value)
    assert "CERTIFICATE_VERIFY_FAILED" in str(async_error.value)
