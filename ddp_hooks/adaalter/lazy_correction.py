r"""Local AdaAlter's lazy correction: what stands in the denominator for the squares a local step cannot know.

During the local steps ``t0 < t <= t0 + H`` of Local AdaAlter (Xie et al.
2019, arXiv 1911.09030) a rank knows the synchronised accumulator ``B2_t0``
but not the squared averaged gradients a synchronous run would have added
since. Each rule puts a placeholder there (``eps^2`` is the paper's ``eps``;
``r`` is per coordinate):

- ``"paper"`` (``True`` before the rules had names):
  :math:`\sqrt{B2_{t_0} + (t - t_0)\,\epsilon^2}`, the paper's rule;
- ``"constant"`` (``False``): :math:`\sqrt{B2_{t_0} + \epsilon^2}`, the
  authors' MXNet code;
- ``"rate"``: :math:`\sqrt{B2_{t_0} + \epsilon^2 + (t - t_0 - 1)\, r}`, with
  ``r`` the mean growth of ``B2`` per step over the last round,
  :math:`\mathrm{mean}_j A_j / H` (before the first averaging, the last
  warm-up step's :math:`g^2`; 0 without warm-up, so the first round runs as
  ``"constant"``): the placeholder is what the accumulator has been gaining,
  not a fixed ``eps^2``, which may be far larger or smaller than a model's
  squared gradients.

All three give synchronous AdaAlter's :math:`\sqrt{B2_{t-1} + \epsilon^2}` at
``t - t0 = 1``, so in warm-up and with ``H = 1``.

Example::

    >>> import torch
    >>> b2, r = torch.tensor([4.0]), torch.tensor([0.5])  # third local step: t - t0 = 3
    >>> [round(denominator(rule, sum_sq=b2, sq_rate=r, eps2=1.0, local_steps=3).item(), 4) for rule in RULES]
    [2.6458, 2.2361, 2.4495]
    >>> check_rule("lazy")
    Traceback (most recent call last):
    ...
    ValueError: `lazy_correction` must be one of 'paper', 'constant', 'rate', got 'lazy'; it is the ...
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .._internal.validation import check_choice

__all__ = ["RULES", "RULE_CODES", "check_rule", "denominator"]

RULES = ("paper", "constant", "rate")
#: The rules' codes in cross-rank checks: explicit and never reused; 0 and 1 are what False and True meant.
RULE_CODES = {"constant": 0, "paper": 1, "rate": 2}


def check_rule(value: Union[str, bool]) -> str:
    """The rule's name; ``True`` and ``False``, the option's values before the rules had names, are
    ``"paper"`` and ``"constant"``."""
    if isinstance(value, bool):
        return "paper" if value else "constant"
    if not isinstance(value, str):
        raise TypeError(f"`lazy_correction` must be one of {', '.join(map(repr, RULES))} or a bool, got {value!r} "
                        f"of type {type(value).__name__}; it names the rule of the denominator during local steps")
    return check_choice("lazy_correction", value, RULES,
                        "it is the placeholder in the denominator for the squares a local step cannot know")


def denominator(rule: str, *, sum_sq: torch.Tensor, sq_rate: Optional[torch.Tensor], eps2: float,
                local_steps: int) -> torch.Tensor:
    """The rule's denominator at local step ``t - t0 = local_steps`` (a new tensor)."""
    if rule == "rate" and local_steps > 1:
        return torch.add(sum_sq, sq_rate, alpha=local_steps - 1).add_(eps2).sqrt_()
    return sum_sq.add((local_steps if rule == "paper" else 1) * eps2).sqrt_()
