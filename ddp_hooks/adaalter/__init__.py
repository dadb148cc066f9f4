"""Local AdaAlter (Xie, Koyejo, Gupta, Lin, 2019, arXiv 1911.09030): its optimizer, hook, averager and schedule.

Re-exports only; each module holds one idea (the maths are in :mod:`.optimizer`).
"""

from .averager import AdaAlterAverager
from .build import build_local_adaalter
from .hook import LocalSGDState, local_sgd_hook
from .lazy_correction import RULE_CODES, RULES, check_rule, denominator
from .optimizer import LocalAdaAlter
from .outer_optimizer import OuterOptimizer
from .outer_sgd import OuterSGD
from .schedule import LocalAdaAlterSchedule
from .sparse_average import SparseAverage

__all__ = [
    "LocalAdaAlter",
    "build_local_adaalter",
    "AdaAlterAverager",
    "OuterSGD",
    "OuterOptimizer",
    "SparseAverage",
    "LocalSGDState",
    "local_sgd_hook",
    "LocalAdaAlterSchedule",
    "RULES",
    "RULE_CODES",
    "check_rule",
    "denominator",
]
