"""The one exception type of `tpudist.mesh`."""


class TopologyError(ValueError):
    """Bad input to `tpudist.mesh`: a slice, rank, coordinate, mesh shape or collective it refuses.

    A `ValueError`, so callers that do not care about the difference still catch it. The message
    states the rule, the offending values as `name=value`, and a fix.
    """
