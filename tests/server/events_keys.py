"""CURVE credentials for KV-events tests: one server key pair, a name key, subscribers by scope."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class Subscriber:
    public: str
    secret: str

    def creds(self, server_public: str) -> dict:
        return {"server_public": server_public, "public": self.public, "secret": self.secret}


def _pair() -> tuple[str, str]:
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


class EventsKeys:
    """Keys for one test server; ``server_config()`` goes into its [server] table and ``server_env()``
    into its environment (the two secrets: a config file that held them would have to be 0600, and
    ``ServerProcess`` writes its file with the umask's mode)."""

    def __init__(self, scopes: dict[str, str]) -> None:
        self.server_public, self.server_secret = _pair()
        self.name_key = secrets.token_bytes(32)
        #: scope label → Subscriber, e.g. {"router": …, "acme": …}
        self.subscribers = {label: Subscriber(*_pair()) for label in scopes}
        self.scopes = scopes

    def server_config(self, endpoint: str = "tcp://127.0.0.1:*") -> dict:
        return {
            "events": endpoint,
            "events_subscribers": [f"{self.subscribers[label].public}={scope}" for label, scope in self.scopes.items()],
        }

    def server_env(self) -> dict:
        return {"KVTIER_SERVE_EVENTS_CURVE_SECRET": self.server_secret,
                "KVTIER_SERVE_EVENTS_NAME_KEY": self.name_key.hex()}

    def creds(self, label: str) -> dict:
        return self.subscribers[label].creds(self.server_public)
