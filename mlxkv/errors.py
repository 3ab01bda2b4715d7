"""The exceptions mlxkv raises. Every one derives from :class:`MLXKVError`."""


class MLXKVError(Exception):
    """Base class: bad input, a damaged or incompatible snapshot, an unknown kind."""


class UnknownKindError(MLXKVError):
    """A cache kind (or persisted kind) that no family of the kind table handles."""

    def __init__(self, kind, where: str = "", known=()):
        self.kind, self.where = kind, where
        at = f" ({where})" if where else ""
        listed = f" Known persisted kinds: {', '.join(known)}." if known else ""
        super().__init__(f"unknown cache kind {kind!r}{at}: no codec or dispatch handles it.{listed}")


class SchemeError(MLXKVError):
    """A cache scheme string or cache option that cannot be built."""


class CacheConfigError(MLXKVError):
    """A cache constructed with inconsistent parameters."""


class RowIndexError(MLXKVError, IndexError):
    """A row index outside a batch (an ``IndexError`` too)."""


class SnapshotError(MLXKVError):
    """A snapshot file that cannot be written or read as asked."""


class CorruptSnapshotError(SnapshotError):
    """Truncated, bit-flipped or structurally invalid snapshot bytes."""


class FormatVersionError(SnapshotError):
    """A snapshot written in a format version this reader does not know."""


class IdentityMismatchError(SnapshotError):
    """The snapshot belongs to another model, tokenizer, config or adapter."""


class GeometryMismatchError(SnapshotError):
    """Layer count or head geometry of a snapshot disagrees with the model."""


class SnapshotWriteError(SnapshotError, OSError):
    """The file system refused the write (no such directory, no permission, disk full): an
    ``OSError`` too, with its ``errno``. Whatever was at the path is unchanged."""


class EmptyCacheError(SnapshotError):
    """Asked to snapshot caches that hold no tokens."""


class UnsupportedKindError(SnapshotError, UnknownKindError):
    """A snapshot names a cache kind this reader cannot restore, or caches are saved in a
    format with no form for their kind. Both a :class:`SnapshotError` and an
    :class:`UnknownKindError`."""

    def __init__(self, kind, message: str):
        self.kind = kind
        MLXKVError.__init__(self, message)


class GenerationFinishedError(MLXKVError):
    """A session was asked for a token after its request finished (a stop token or its
    ``max_tokens``-th token was emitted): start the next turn with ``add_turn``."""


class StoreCapacityError(MLXKVError):
    """A prompt store cannot hold an entry: larger than its byte cap, or pinned entries
    leave no room for it. Nothing is stored and nothing held is lost."""


class StoreTrustError(MLXKVError):
    """A prompt-store tier whose content the store cannot trust: a directory another user can
    write or own, a shared tier opened without the secret its entries are authenticated with,
    a namespace the store holds no key for."""


class ModelError(MLXKVError):
    """A model ``mlxkv.models`` cannot fetch or convert: an unknown name or dtype, a GGUF
    tensor or setting the conversion does not map."""


class ModelDownloadError(ModelError):
    """pip could not download a model's packages (no registry reachable, no such version)."""


class ModelChecksumError(ModelError):
    """A downloaded GGUF file whose sha256 is not the one its package and mlxkv record."""


class EagerDecodeWarning(UserWarning):
    """A decode step ran eagerly because a cache cannot enter a compiled one (its kind has
    no decode step builder, or refuses this step; ``CompiledDecoder(..., fallback="eager")``)."""
