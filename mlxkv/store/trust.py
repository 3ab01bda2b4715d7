"""Who may write the shared tier's entries: keys derived from the operator's secret.

Every entry in Redis carries an HMAC-SHA256 over its manifest fields and every byte of its
pieces, keyed by the key of its namespace. A namespace's key is derived from one secret the
operator gives every server of a deployment (``namespace_key``); a server that serves every
namespace holds the secret, a tenant's server may hold only its own namespaces' keys, and
then can neither write an entry another namespace's readers accept nor read one. Entries
that do not authenticate are misses (counted, never served, never deleted: a reader with
the wrong secret must not destroy a deployment's entries). docs/store.md, "Trust".
"""

import hashlib
import hmac

from ..errors import MLXKVError, StoreTrustError

NAMESPACE_TAG = b"mlxkv-store-namespace-1\n"
ENTRY_TAG = b"mlxkv-store-entry-1\n"
MIN_SECRET = 16  # bytes


def _bytes(secret, what: str) -> bytes:
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes | bytearray) or len(secret) < MIN_SECRET:
        raise MLXKVError(f"{what} must be at least {MIN_SECRET} bytes (a str or bytes), e.g. `openssl rand -hex 32`")
    return bytes(secret)


def namespace_key(secret, ns: str) -> bytes:
    """The key of namespace ``ns`` under a deployment's ``secret``: give a tenant's server
    ``namespace_keys={ns: namespace_key(secret, ns)}`` and it can write that namespace only."""
    return hmac.new(_bytes(secret, "the secret"), NAMESPACE_TAG + ns.encode(), hashlib.sha256).digest()


class Keys:
    """The keys a store holds: every namespace's (``secret``) or some (``namespace_keys``)."""

    def __init__(self, secret=None, namespace_keys: dict | None = None):
        self._secret = None if secret is None else _bytes(secret, "the secret")
        self._given = {ns: _bytes(k, f"the key of namespace {ns!r}") for ns, k in (namespace_keys or {}).items()}
        self._derived: dict[str, bytes] = {}

    def __bool__(self):
        return self._secret is not None or bool(self._given)

    def key(self, ns: str) -> bytes | None:
        if ns in self._given:
            return self._given[ns]
        if self._secret is None:
            return None
        k = self._derived.get(ns)
        if k is None:
            k = self._derived[ns] = namespace_key(self._secret, ns)
        return k

    def require(self, ns: str) -> bytes:
        k = self.key(ns)
        if k is None:
            raise StoreTrustError(
                f"this store holds no key of namespace {ns!r}: give the deployment's secret, or "
                "namespace_keys with that namespace's key"
            )
        return k


class EntryMac:
    """HMAC-SHA256 of one shared entry, fed piece by piece: its space, id, upload and header
    text, then for each piece in order its tensor name, length and bytes (each field
    length-prefixed, u64le). docs/store.md gives the byte layout."""

    def __init__(self, key: bytes, space: str, eid: str, upload: str, header: str):
        self._h = hmac.new(key, ENTRY_TAG, hashlib.sha256)
        for field in (space, eid, upload, header):
            data = field.encode()
            self._h.update(len(data).to_bytes(8, "little") + data)

    def piece(self, name: str, data) -> None:
        tag = name.encode()
        self._h.update(len(tag).to_bytes(8, "little") + tag + len(data).to_bytes(8, "little"))
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def matches(self, mac) -> bool:
        return isinstance(mac, str) and hmac.compare_digest(self.hexdigest(), mac)
