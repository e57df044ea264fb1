"""Connecting to the broker: addresses and failover, credentials, TLS, what a lost
connection looks like (:data:`RECOVERABLE`) and the backoff between attempts."""

from __future__ import annotations

import random
import re
import ssl
import stat
import struct
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pika
import pika.data
import pika.exceptions

from hpcrl_common.config import BrokerSettings


def _decode_header_value(encoded: bytes, offset: int) -> tuple[Any, int]:
    """pika's header decoder, except that a timestamp datetime cannot hold becomes its
    integer: pika's ValueError would drop the connection before any callback, again on every
    redelivery, taking the messages prefetched with it into the DLQ unhandled."""
    if encoded[offset : offset + 1] == b"T":
        seconds = struct.unpack_from(">Q", encoded, offset + 1)[0]
        try:
            return datetime.fromtimestamp(seconds, UTC), offset + 9
        except (OverflowError, ValueError, OSError):
            return seconds, offset + 9
    return _PIKA_DECODE_VALUE(encoded, offset)


# pika.data.decode_table looks decode_value up by its module-global name, so nested tables
# and arrays take this path too.
_PIKA_DECODE_VALUE = pika.data.decode_value
pika.data.decode_value = _decode_header_value

# Connection-level trouble that a reconnect cures. Unroutable/nacked publishes are not in it.
RECOVERABLE = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.AMQPChannelError,
    pika.exceptions.ConnectionWrongStateError,
    pika.exceptions.StreamLostError,
    ConnectionError,
)


class BrokerSetupError(RuntimeError):
    """A setting that cannot work (unreadable password file, bad TLS files): not retried."""


class TlsRefused(pika.exceptions.AMQPConnectionError):
    """The TLS handshake failed: a wrong CA, name or port, or a missing client certificate.

    Retried like any lost connection (a certificate may be rotated), with this message.
    """


_TLS_ALERT = re.compile(r"\[SSL: (?P<code>[A-Z0-9_]+)\] (?P<text>.+?) \(_ssl")


def open_connection(
    params: pika.URLParameters | Sequence[pika.URLParameters],
) -> pika.BlockingConnection:
    """Connect to the first broker address of ``params`` that takes the connection.

    ``params`` is one address or several (:func:`connection_parameters`: ``url`` and then
    ``failover_urls``), tried in order; when none can be reached, the error is the last one's.
    """
    configs = [params] if isinstance(params, pika.connection.Parameters) else list(params)
    try:
        return pika.BlockingConnection(configs)
    except ssl.SSLCertVerificationError as exc:
        raise TlsRefused(
            f"TLS: the broker's certificate was refused ({exc.verify_message}); check "
            f"broker.tls_ca_file and broker.tls_server_name"
        ) from None
    except ssl.SSLError as exc:
        raise TlsRefused(
            f"TLS handshake with the broker failed ({exc.reason or exc}); is the URL's port a "
            f"TLS listener, and does the broker require a client certificate "
            f"(broker.tls_cert_file)?"
        ) from None
    except pika.exceptions.AMQPConnectionError as exc:
        # TLS 1.3: the broker judges our certificate after the handshake, so its alert
        # arrives as a lost stream, not as an SSLError.
        tls = any(config.ssl_options is not None for config in configs)
        alert = _TLS_ALERT.search(str(exc)) if tls else None
        if alert is None and tls and "SSLEOFError" in str(exc):
            # The broker sent its alert and closed before we read it, so our first write
            # after the handshake met a closed socket; a refused certificate is the cause
            # seen (a broker that refuses for another reason says so in AMQP).
            raise TlsRefused(
                "TLS: the broker closed the connection right after the handshake without "
                "saying why, as it does when it refuses our client certificate; is "
                "broker.tls_cert_file set, signed by a CA the broker trusts, and valid?"
            ) from None
        if alert is None:
            raise
        if alert["code"].endswith("CERTIFICATE_REQUIRED"):
            raise TlsRefused(
                f"TLS: the broker requires a client certificate ({alert['text']}); set "
                f"broker.tls_cert_file and broker.tls_key_file"
            ) from None
        raise TlsRefused(
            f"TLS: the broker refused our client certificate ({alert['text']}); is "
            f"broker.tls_cert_file signed by a CA the broker trusts, and valid?"
        ) from None


def connection_parameters(settings: BrokerSettings, client: str) -> list[pika.URLParameters]:
    """Parameters of every broker address, in the order to try them: ``url``, then
    ``broker.failover_urls`` (other nodes of the same cluster).

    url's user and password (or ``password_file``'s) and the TLS settings apply to each. One
    connection attempt is one pass over the list (``connection_attempts`` 1, unless a URL's
    query says otherwise): the callers retry with their own backoff (:class:`Consumer`,
    :meth:`Publisher.publish`), starting again from ``url``.
    """
    first = pika.URLParameters(_with_password_field(settings.url))
    credentials = first.credentials
    if settings.password_file is not None:
        credentials = pika.PlainCredentials(
            credentials.username, read_password(settings.password_file)
        )
    context = tls_context(settings) if urlsplit(settings.url).scheme == "amqps" else None
    all_params = []
    for index, url in enumerate([settings.url, *settings.failover_urls]):
        # A failover URL's user:password (if any) is url's (config checks): leave it to
        # pika, which cannot parse a user without a password.
        params = pika.URLParameters(_without_userinfo(url)) if index else first
        params.credentials = credentials
        params.heartbeat = settings.heartbeat_s
        params.blocked_connection_timeout = 60
        params.client_properties = {"connection_name": client, "product": "hpcrl"}
        query = parse_qs(urlsplit(url).query)
        if "connection_attempts" not in query:
            params.connection_attempts = 1
        if "retry_delay" not in query:
            params.retry_delay = settings.reconnect_initial_s
        if context is not None:
            params.ssl_options = pika.SSLOptions(context, settings.tls_server_name or params.host)
        all_params.append(params)
    return all_params


def _with_password_field(url: str) -> str:
    """``user@host`` as ``user:@host``: pika cannot parse a user without a password, which is
    how a URL reads when the password comes from ``broker.password_file``."""
    parts = urlsplit(url)
    if parts.username is None or parts.password is not None:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    return parts._replace(netloc=f"{userinfo}:@{host}").geturl()


def _without_userinfo(url: str) -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def broker_address(connection: pika.BlockingConnection) -> str:
    """host:port of the broker node a connection is open to (for logs), or "?"."""
    params = getattr(getattr(connection, "_impl", None), "params", None)
    return "?" if params is None else f"{params.host}:{params.port}"


def read_password(path: Path) -> str:
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as exc:
        raise BrokerSetupError(f"broker.password_file {path}: {exc.strerror}") from None
    if mode & stat.S_IROTH:
        raise BrokerSetupError(
            f"broker.password_file {path} is readable by every user: chmod 600 it"
        )
    password = text.strip("\r\n")
    if not password:
        raise BrokerSetupError(f"broker.password_file {path} is empty")
    return password


def tls_context(settings: BrokerSettings) -> ssl.SSLContext:
    """Verify the broker's certificate and name against the CA; optionally show ours."""
    try:
        context = ssl.create_default_context(
            cafile=None if settings.tls_ca_file is None else str(settings.tls_ca_file)
        )
        if settings.tls_cert_file is not None:
            context.load_cert_chain(
                str(settings.tls_cert_file),
                None if settings.tls_key_file is None else str(settings.tls_key_file),
            )
    except (OSError, ssl.SSLError) as exc:
        raise BrokerSetupError(f"broker TLS files: {exc}") from None
    return context


class _Backoff:
    def __init__(self, settings: BrokerSettings) -> None:
        self.initial, self.cap = settings.reconnect_initial_s, settings.reconnect_max_s
        self.current = self.initial

    def next(self) -> float:
        delay = self.current * random.uniform(0.8, 1.2)
        self.current = min(self.current * 2, self.cap)
        return delay

    def reset(self) -> None:
        self.current = self.initial
