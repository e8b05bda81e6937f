"""Redis URLs (kumiko_dramatiq.broker.urls) and the ACL rule set (kumiko_dramatiq.broker.acl),
without a server: parsing, validation, one-line errors, TLS error recognition."""

from __future__ import annotations

import re
import ssl
from pathlib import Path
from typing import Any

import pytest
import redis
from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer, SSLConnection
from redis.utils import HIREDIS_AVAILABLE

from kumiko_dramatiq import JobConfigError
from kumiko_dramatiq.broker import acl
from kumiko_dramatiq.broker.connection import SentinelPool, client, connection_pool, describe
from kumiko_dramatiq.broker.lua import commands as lua_commands
from kumiko_dramatiq.broker.lua import source as lua_source
from kumiko_dramatiq.broker.packer import RespPacker
from kumiko_dramatiq.broker.tls import tls_problem
from kumiko_dramatiq.broker.urls import parse, url_problem
from kumiko_dramatiq.errors import redact_url
from kumiko_dramatiq.settings import Settings


@pytest.fixture
def pem(tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    path.write_text("not checked here: only that the file is readable")
    return str(path)


# -- accepted forms -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/15",
        "redis://h",
        "redis://user:p%40ss@h:7000/2",
        "redis://[::1]:6379/0",
        "unix:///run/redis.sock?db=3",
        "redis://h/0?health_check_interval=30&socket_keepalive=true",
        "redis+sentinel://a:26379,b:26380,c/1?master=main",
        "redis+sentinel://u:pw@a/0?master=main&sentinel_password=s",
    ],
)
def test_every_documented_form_is_accepted(url: str) -> None:
    assert url_problem(url) is None
    Settings(redis_url=url)


def test_a_rediss_url_carries_its_tls_options_typed(pem: str) -> None:
    target = parse(f"rediss://u:pw@h:6380/4?ssl_ca_certs={pem}&ssl_cert_reqs=Required")
    connection = dict(target.connection)
    assert connection["connection_class"] is SSLConnection
    assert (connection["host"], connection["port"], connection["db"]) == ("h", 6380, 4)
    assert (connection["username"], connection["password"]) == ("u", "pw")
    assert connection["ssl_ca_certs"] == pem
    assert connection["ssl_cert_reqs"] == "required"
    assert connection["ssl_check_hostname"] is True


def test_ssl_cert_reqs_none_turns_the_host_name_check_off() -> None:
    connection = parse("rediss://h/0?ssl_cert_reqs=none").connection
    assert connection["ssl_cert_reqs"] == "none"
    assert connection["ssl_check_hostname"] is False


def test_a_sentinel_url_names_sentinels_master_db_and_both_credentials() -> None:
    target = parse("redis+sentinel://u:p%3Aw@a:1,[::1]:2,c/5?master=m&sentinel_password=s")
    assert target.sentinels == (("a", 1), ("::1", 2), ("c", 26379))
    assert target.master == "m"
    assert dict(target.connection) == {"db": 5, "username": "u", "password": "p:w"}
    assert dict(target.sentinel_auth) == {"password": "s"}
    assert "p:w" not in repr(target)


# -- refused forms: one line, naming the option, never a password ---------------------------
@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("http://h/0", "redis+sentinel://"),
        ("redis://h:70000/0", "valid port"),
        ("redis://h/zero", "by number"),
        ("redis://h/1?db=2", "twice"),
        ("redis://h/0?ssl_cert_reqs=none", "ssl_cert_reqs"),
        ("redis://h/0?sokcet_keepalive=1", "sokcet_keepalive"),
        ("rediss://h/0?ssl_ca_certs=/no/such/ca.pem", "ssl_ca_certs"),
        ("rediss://h/0?ssl_ca_path=/no/such/dir", "ssl_ca_path"),
        ("rediss://h/0?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
        ("rediss://h/0?ssl_cert_reqs=none&ssl_check_hostname=true", "ssl_check_hostname"),
        ("rediss://h/0?health_check_interval=soon", "health_check_interval"),
        ("redis+sentinel://a,b/0", "master"),
        ("redis+sentinel:///0?master=m", "sentinels"),
        ("redis+sentinel://a:x/0?master=m", "valid port"),
        ("redis+sentinel://a/0?master=m&master=n", "master"),
        ("unix://", "socket path"),
    ],
)
def test_a_bad_url_is_one_line_naming_what_is_wrong(url: str, named: str) -> None:
    with pytest.raises(JobConfigError, match="redis_url") as caught:
        Settings(redis_url=url)
    assert named in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_keyfile_without_its_certificate_is_refused(pem: str) -> None:
    assert "ssl_certfile" in str(url_problem(f"rediss://h/0?ssl_keyfile={pem}"))


def test_no_password_shows_in_an_error() -> None:
    for url in (
        "redis://user:hunter2@h/0?sokcet=1",
        "redis+sentinel://user:hunter2@a/0?sentinel_password=hunter2",
        "redis+sentinel://a/0?master=m&sentinel_password=",
    ):
        with pytest.raises(JobConfigError) as caught:
            Settings(redis_url=url)
        assert "hunter2" not in str(caught.value)


def test_redact_url_hides_sentinel_passwords_too() -> None:
    url = "redis+sentinel://u:pw@a:1,b:2/0?master=m&sentinel_password=s3cret&x=1"
    assert redact_url(url) == "redis+sentinel://u:***@a:1,b:2/0?master=m&sentinel_password=***&x=1"


# -- pools ----------------------------------------------------------------------------------
def test_a_sentinel_url_makes_a_sentinel_pool_with_the_timeouts() -> None:
    pool = connection_pool("redis+sentinel://a:1,b:2/3?master=m", timeout_s=1.5)
    assert isinstance(pool, SentinelPool)
    assert pool.service_name == "m"
    assert pool.connection_kwargs["db"] == 3
    assert pool.connection_kwargs["socket_timeout"] == 1.5
    hosts = [s.connection_pool.connection_kwargs["host"] for s in pool.sentinel_manager.sentinels]
    assert hosts == ["a", "b"]
    made = client("redis+sentinel://a:1,b:2/3?master=m", timeout_s=1)
    assert describe(made) == "redis+sentinel://a:1,b:2/3?master=m"
    made.close()


def test_a_rediss_pool_uses_tls_connections() -> None:
    pool = connection_pool("rediss://h:6380/1", timeout_s=2)
    assert issubclass(pool.connection_class, SSLConnection)
    assert pool.connection_kwargs["ssl_cert_reqs"] == "required"


# -- TLS errors -----------------------------------------------------------------------------
def _wrapped(cause: BaseException) -> redis.ConnectionError:
    try:
        try:
            raise cause
        except OSError as exc:
            raise redis.ConnectionError(f"Error connecting: {exc}") from None
    except redis.ConnectionError as outer:
        outer.__context__ = cause
        return outer


def test_a_certificate_that_does_not_verify_is_a_tls_problem() -> None:
    cause = ssl.SSLCertVerificationError(1, "certificate verify failed")
    cause.verify_message = "self-signed certificate in certificate chain"
    problem = tls_problem(_wrapped(cause))
    assert problem is not None
    assert "self-signed certificate" in problem
    assert "ssl_ca_certs" in problem


def test_a_plain_port_behind_rediss_is_a_tls_problem() -> None:
    text = "Error 1 connecting to h:6379. [SSL: WRONG_VERSION_NUMBER] wrong version number."
    assert "does not speak TLS" in str(tls_problem(redis.ConnectionError(text)))


def test_a_refused_connection_is_no_tls_problem() -> None:
    assert tls_problem(redis.ConnectionError("Connection refused")) is None


# -- the ACL rule set -----------------------------------------------------------------------
def test_the_rule_set_holds_every_script_command_and_every_command_sent_from_python() -> None:
    commands = acl.commands()
    assert set(lua_commands()) <= set(commands)
    assert set(acl.CLIENT_COMMANDS) <= set(commands)
    assert commands == sorted(set(commands))


def test_the_start_up_probe_checks_every_command_of_the_rule_set() -> None:
    # the probe's table of harmless arguments, one entry per command (lua/probe.lua)
    table = lua_source("probe").partition("local specs = {")[2].partition("\n}\n")[0]
    entries = set(re.findall(r'(?:\["([a-z|]+)"\]|\b([a-z]+)) = \{', table))
    probed = {quoted or plain for quoted, plain in entries}
    assert probed == set(acl.commands())


def test_a_prefixed_rule_set_is_that_datasets_keys_alone() -> None:
    rules = acl.rules("orders")
    assert rules[:3] == ["resetkeys", "resetchannels", "-@all"]
    assert [r for r in rules if r.startswith("~")] == [
        "~kumiko:orders:*",
        "~dramatiq",
        "~dramatiq:orders-*",
        "~dramatiq:__acks__.*.orders-*",
        "~dramatiq:__heartbeats__",
    ]
    assert "+evalsha" in rules
    assert "+blpop" not in acl.rules("orders", without="blpop")


def test_setuser_spells_one_acl_line() -> None:
    line = acl.setuser("kumiko", "orders", password="s3cret")
    assert line.startswith("ACL SETUSER kumiko on >s3cret resetkeys resetchannels -@all +")
    assert "\n" not in line


# -- packing commands -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "command",
    [
        ("EVALSHA", "f" * 40, 2, b"k1", "k\u00e9y", "x" * 20_000, 12345, -3, b""),
        ("CLIENT SETNAME", "kumiko-bell:q"),
        (b"GET", b"k"),
        ("SET", "k", 1.5),
        ("SET", "k", memoryview(b"view")),
    ],
)
def test_kumikos_packer_writes_what_redis_pys_writes(command: tuple[Any, ...]) -> None:
    # Given redis-py's own packer and kumiko's, for the same encoding
    encoder = Encoder("utf-8", "strict", False)  # type: ignore[no-untyped-call]
    theirs = PythonRespSerializer(6000, encoder.encode)
    ours = RespPacker("utf-8", "strict", 6000)
    # Then both put the same bytes on the wire
    expected = b"".join(map(bytes, theirs.pack(*command)))  # type: ignore[no-untyped-call]
    assert b"".join(map(bytes, ours.pack(*command))) == expected


@pytest.mark.parametrize("value", [True, None, object()])
def test_kumikos_packer_refuses_what_redis_py_refuses(value: object) -> None:
    with pytest.raises(redis.DataError, match="Invalid input"):
        RespPacker("utf-8", "strict", 6000).pack("SET", "k", value)


def test_a_pool_packs_with_kumikos_packer_unless_hiredis_is_there() -> None:
    pool = connection_pool("redis://127.0.0.1:6379/15", timeout_s=1)
    packer = pool.connection_kwargs.get("command_packer")
    assert isinstance(packer, RespPacker) != HIREDIS_AVAILABLE
