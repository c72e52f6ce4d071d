"""Authentication of KV messenger peers: a shared deployment secret proven by HMAC-SHA256
challenge-response in both directions before any NIXL metadata is exchanged.

The secret comes from the file named by the ``messenger_secret_file`` parameter, else from the
environment variable ``TRITON_DISAGG_MESSENGER_SECRET``; ``triton-disagg serve`` (and the
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

import hashlib
import hmac
import os
import secrets
from pathlib import Path

SECRET_ENV = "TRITON_DISAGG_MESSENGER_SECRET"
MIN_SECRET_BYTES = 16


class AuthError(RuntimeError):
    """A peer failed to prove the deployment secret (or none is configured here)."""


def load_secret(secret_file: str = "") -> bytes:
    """The deployment secret, from ``secret_file`` if given, else from the environment."""
    if secret_file:
        try:
            secret = Path(secret_file).read_bytes().strip()
        except OSError as e:
            raise AuthError(f"messenger_secret_file {secret_file!r}: {e}") from None
    else:
        secret = os.environ.get(SECRET_ENV, "").strip().encode()
    if len(secret) < MIN_SECRET_BYTES:
        where = f"file {secret_file!r}" if secret_file else f"environment variable {SECRET_ENV}"
        raise AuthError(
            f"the KV messenger needs a shared secret of at least {MIN_SECRET_BYTES} bytes ({where} "
            f"{'holds too few' if secret else 'is empty'}); `triton-disagg serve` generates one per run, a "
            "split deployment gives every server the same one"
        )
    return secret


def new_secret() -> str:
    return secrets.token_hex(32)


def new_nonce() -> str:
    return secrets.token_hex(16)


def proof(secret: bytes, role: str, first: str, second: str) -> str:
    return hmac.new(secret, f"{role}|{first}|{second}".encode(), hashlib.sha256).hexdigest()


def verify(secret: bytes, role: str, first: str, second: str, claimed: str) -> None:
    if not hmac.compare_digest(proof(secret, role, first, second), claimed):
        raise AuthError(f"the peer did not prove the deployment secret ({role} proof is wrong)")
