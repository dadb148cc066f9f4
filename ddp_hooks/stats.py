"""Communication counters kept by a hook state."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict


@dataclass
class CommStats:
    """Counts since the start of training (restored on resume).

    ``bytes_sent`` is the payload this rank contributes to its collectives
    (values, plus indices where the receivers need them); ``bytes_dense`` is
    what the same steps would have contributed with a plain allreduce of the
    gradient in its own dtype. On the wire, a ring allreduce moves about
    ``2 (W-1)/W`` times its payload per rank and an allgather ``W-1`` times,
    for W ranks; benchmarks report measured time, these count payload.
    """

    steps: int = 0
    compressed_steps: int = 0
    elements_sent: int = 0
    elements_dense: int = 0
    bytes_sent: int = 0
    bytes_dense: int = 0

    def add(self, elements_sent: int, bytes_sent: int, elements_dense: int, bytes_dense: int) -> None:
        self.elements_sent += elements_sent
        self.bytes_sent += bytes_sent
        self.elements_dense += elements_dense
        self.bytes_dense += bytes_dense

    def as_dict(self) -> Dict[str, float]:
        out: Dict[str, float] = dict(asdict(self))
        out["compression_ratio"] = self.bytes_dense / self.bytes_sent if self.bytes_sent else 1.0
        return out

    def state_dict(self) -> Dict[str, int]:
        return dict(asdict(self))

    def load_state_dict(self, sd: Dict[str, int]) -> None:
        for name in asdict(self):
            value = sd.get(name)
            if not isinstance(value, int):
                raise ValueError(f"hook state 'stats' lacks the int counter {name!r} (got {value!r})")
            setattr(self, name, value)
