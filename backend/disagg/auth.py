"""The deployment secret, and the authentication of KV messenger peers with it: HMAC-SHA256
challenge-response in both directions before any NIXL metadata is exchanged (the same secret
signs the membership records, drain requests and the agents' API).

The secret comes from the file named by the ``deployment_secret_file`` parameter (flag
``--deployment-secret-file``), else from the environment variable
``TRITON_DISAGG_DEPLOYMENT_SECRET``. The old names ``messenger_secret_file``,
``--messenger-secret-file`` and ``TRITON_DISAGG_MESSENGER_SECRET`` still work for a release,
through one helper wherever the setting is read (:func:`accept_renamed`; flags:
:func:`add_secret_flag` and :func:`parse_args`). ``triton-disagg serve`` (and the
``TritonServer`` launcher) generate one per run when none is given, so every model of one
server shares it; a deployment split across servers must give all of them the same secret.
A prefill or decode instance without a secret refuses to start.

Handshake (the connecting decode instance D, the listening prefill instance P)::

    D -> P  AuthChallenge(version, name, nonce_d)
    P -> D  AuthResponse(nonce_p, proof_p = HMAC(secret, "prefill" | nonce_d | nonce_p))
    D -> P  Hello(version, name, fabric, proof_d = HMAC(secret, "decode" | nonce_p | nonce_d))
    P -> D  Hello(version, name, fabric, "")           or {"error": reason} at any step

Each side checks the other's proof before it sends its own NIXL metadata; the role labels
keep a proof from being reflected back. The messages themselves are not encrypted: see the
README's "Security and failure model".
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

log = logging.getLogger("triton_disagg.auth")
SECRET_ENV = "TRITON_DISAGG_DEPLOYMENT_SECRET"
MIN_SECRET_BYTES = 16
# old name -> new name, accepted for one release: the model parameter (also the CLI flags'
# argparse destination) and the environment variable
RENAMED = {"messenger_secret_file": "deployment_secret_file", "TRITON_DISAGG_MESSENGER_SECRET": SECRET_ENV}
_warned: set[str] = set()
V = TypeVar("V")


def accept_renamed(values: Mapping[str, V], spell: Callable[[str], str] = str) -> dict[str, V]:
    """``values`` (parameters, environment, parsed flags) with each old name of :data:`RENAMED`
    given (not empty) moved to its new name, logging one deprecation line per old name per
    process; the old and the new name given with different values is an error naming both
    (``spell``: how the names read to the user, e.g. as flags)."""
    out = dict(values)
    for old, new in RENAMED.items():
        value = out.pop(old, None)
        if value is None or value == "":
            continue
        if out.get(new) not in (None, "", value):
            raise ValueError(f"{spell(old)} and {spell(new)} are both given, with different values: give {spell(new)}")
        if old not in _warned:
            _warned.add(old)
            log.warning("%s is deprecated and will be removed: use %s", spell(old), spell(new))
        out[new] = value
    return out


def flag(name: str) -> str:
    """A setting's name as a command-line flag (``deployment_secret_file`` -> ``--deployment-secret-file``)."""
    return "--" + name.replace("_", "-")


def add_secret_flag(p: argparse.ArgumentParser, help: str) -> None:
    """``--deployment-secret-file FILE``, and its old name, hidden, until :func:`parse_args`
    moves it to the new one."""
    p.add_argument(flag("deployment_secret_file"), default="", metavar="FILE", help=help)
    p.add_argument(flag("messenger_secret_file"), default="", help=argparse.SUPPRESS)


def parse_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p.parse_args(argv)`` with old flags' values under their new names (a conflict is a usage error)."""
    try:
        return argparse.Namespace(**accept_renamed(vars(p.parse_args(argv)), spell=flag))
    except ValueError as e:
        p.error(str(e))


class AuthError(RuntimeError):
    """A peer failed to prove the deployment secret (or none is configured here)."""


def load_secret(secret_file: str = "") -> bytes:
    """The deployment secret, from ``secret_file`` if given, else from the environment."""
    if secret_file:
        try:
            secret = Path(secret_file).read_bytes().strip()
        except OSError as e:
            raise AuthError(f"deployment_secret_file {secret_file!r}: {e}") from None
    else:
        secret = env_secret().encode()
    if len(secret) < MIN_SECRET_BYTES:
        where = f"file {secret_file!r}" if secret_file else f"environment variable {SECRET_ENV}"
        raise AuthError(
            f"the deployment needs a shared secret of at least {MIN_SECRET_BYTES} bytes ({where} "
            f"{'holds too few' if secret else 'is empty'}); `triton-disagg serve` generates one per run, a "
            "split deployment gives every server the same one"
        )
    return secret


def env_secret() -> str:
    """The secret the environment gives (``SECRET_ENV``, or its old name); "" if none."""
    try:
        return accept_renamed(os.environ).get(SECRET_ENV, "").strip()
    except ValueError as e:
        raise AuthError(str(e)) from None


def new_secret() -> str:
    return secrets.token_hex(32)


def new_nonce() -> str:
    return secrets.token_hex(16)


def proof(secret: bytes, role: str, first: str, second: str) -> str:
    return hmac.new(secret, f"{role}|{first}|{second}".encode(), hashlib.sha256).hexdigest()


def verify(secret: bytes, role: str, first: str, second: str, claimed: str) -> None:
    if not hmac.compare_digest(proof(secret, role, first, second), claimed):
        raise AuthError(f"the peer did not prove the deployment secret ({role} proof is wrong)")
