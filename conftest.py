"""Doctests of ``ddp_hooks/integrations``: skip each framework's module where that framework is not installed
(its tests in ``tests/integrations`` skip with the reason)."""

import importlib.util

collect_ignore = [f"ddp_hooks/integrations/{name}.py" for name in ("lightning", "accelerate", "transformers")
                  if importlib.util.find_spec(name) is None]
