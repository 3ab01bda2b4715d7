"""State: the kind table, snapshots, sessions, identity, reuse rules and stores, composed
from the layers below."""
