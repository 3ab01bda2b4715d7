"""The kind table's records (``records.py``: one per cache family, registered when mlxkv is
imported), the capability predicates read from them (``predicates.py``) and caches as header
entries and back (``entries.py``)."""
