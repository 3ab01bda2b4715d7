"""State besides the caches, that files record and the store and sessions share: identity
(who a snapshot belongs to), generation checkpoints, sampling and the request key, and the
prefix-reuse rules."""
