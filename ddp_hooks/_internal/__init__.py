"""Building blocks shared by the package's algorithms; not public API.

* :mod:`.validation`: argument checks whose errors name the argument, the value, the rule and why.
* :mod:`.collectives`: future-returning collectives, the group's size and rank, cross-rank agreement.
* :mod:`.codec`: settings as int64 (floats as their IEEE-754 bits), for checkpoints and agreement.
"""
