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


def test_rank_files_refuse_states_saved_at_another_world_size(tmp_path):
    from ddp_hooks import SparsifyState
    import torch

    from ddp_hooks.integrations.rank_files import RankFiles

    files = RankFiles(SparsifyState(density=0.1))
    with pytest.raises(FileNotFoundError, match="would restart at zero"):
        files.load(str(tmp_path))
    torch.save({"state": {}}, tmp_path / "comm_hook_state-rank0-of-2.pt")
    with pytest.raises(FileNotFoundError, match=r"rank0-of-1.pt does not exist; the folder holds "
                                                r"\['comm_hook_state-rank0-of-2.pt'\]: the states were saved at "
                                                "another world size"):
        files.load(str(tmp_path))
    saved = files.save(str(tmp_path), note=3)
    assert files.read(str(tmp_path))["note"] == 3 and saved.endswith("comm_hook_state-rank0-of-1.pt")
    with pytest.raises(TypeError, match="must have a state_dict"):
        RankFiles(object())
