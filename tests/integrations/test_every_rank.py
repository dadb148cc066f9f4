"""EveryRankState's refusals: a state it did not save, one saved at another world size, a state without
state_dict (one process, no framework needed; the round trip at 2 ranks is in the framework tests)."""

import pytest

from ddp_hooks import SparsifyState
from ddp_hooks.integrations import EveryRankState


def test_what_cannot_be_resumed_is_refused_with_the_reason():
    state = EveryRankState(SparsifyState(method="random_block", density=0.1))
    with pytest.raises(ValueError, match=r"must come from EveryRankState.state_dict\(\).*with keys \['residuals'\]"):
        state.load_state_dict({"residuals": []})
    saved = state.state_dict()
    saved["world_size"] = 2
    with pytest.raises(ValueError, match=r"saved by 2 ranks but 1 load them: each rank resumes its own state"):
        state.load_state_dict(saved)
    with pytest.raises(TypeError, match=r"`hook_state` must have a state_dict\(\) method .*got int"):
        EveryRankState(3)
