"""The bf16-first conversion rule as numbers: when a plain storage converts and the reuse
floor the conversion sets. Imports nothing, so a restore's floor and a conversion of files
that carry a pending conversion read it without a live cache (``transition.py`` applies it)."""


def conversion_due(start, offset):
    """mlx-bun's ``transitionDue``: does a plain storage that an append just left holding
    ``offset`` positions convert now, for a conversion at ``start``? Once it holds ``start``
    (with ``start == 0``: once it holds any). ``offset`` may be an array of rows' offsets."""
    return (offset > 0) & (offset >= start)


def conversion_floor(start, at):
    """The reuse floor a conversion at position ``at`` sets: ``at`` after position 0
    (earlier prefixes were never stored in the target's precision), else 0."""
    return at if start > 0 else 0 * at
