"""One codec per persisted kind: header fields and tensor slots of a live cache, and the
cache rebuilt from them. Codecs know nothing of files."""
