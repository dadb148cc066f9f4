"""value_dtype: values travel in half precision, the rounding stays in the residual and is sent later."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparsifyState, sparsify_hook
from ddp_hooks.sparsify.selectors import budget
from ddp_hooks.testing import assert_replicas_equal, run_distributed
from small_mlp import batch, small_mlp

# (method, aggregation): shared positions by AllReduce, own positions by AllGather (with and without positions
# on the wire), and the leaders' positions
PATHS = [("random_block", "allreduce"), ("randomk", "allgather"), ("topk", "allgather"), ("shared_topk", "allreduce")]


def test_value_dtype_takes_names_and_torch_dtypes_and_refuses_others():
    assert SparsifyState(value_dtype=torch.float16).options.value_dtype == "float16"
    assert SparsifyState(value_dtype="bfloat16").options.value_dtype == "bfloat16"
    assert SparsifyState().options.value_dtype is None
    assert SparsifyState().options.wire_dtype(torch.bfloat16) == torch.bfloat16  # None: the gradient's own
    assert SparsifyState(value_dtype="float16").options.wire_dtype(torch.float32) == torch.float16
    with pytest.raises(ValueError, match=r"`value_dtype` must be None or one of .* got torch.int8; it is the dtype"):
        SparsifyState(value_dtype=torch.int8)
    with pytest.raises(ValueError, match="`value_dtype`.*got 'half'"):
        SparsifyState(value_dtype="half")


def test_a_state_saved_before_value_dtype_loads_as_the_gradients_own_dtype():
    saved = SparsifyState().state_dict()
    del saved["config"]["value_dtype"]
    SparsifyState().load_state_dict(saved)  # what it ran with: values in the gradient's dtype
    with pytest.raises(ValueError, match=r"differing: value_dtype\).*value_dtype=None.*value_dtype='float16'"):
        SparsifyState(value_dtype="float16").load_state_dict(saved)


def _recording_hook(record, bucket):
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        record["g"][id(p)] = g.detach().clone()
    return sparsify_hook(record["state"], bucket)


def _rounding_kept(rank, world, dtype_name):
    bytes_sent = {}
    for method, aggregation in PATHS:
        for value_dtype in (None, dtype_name):
            state = SparsifyState(method=method, aggregation=aggregation, density=0.1, density_warmup_steps=0,
                                  value_dtype=value_dtype, seed=5)
            model = DDP(small_mlp(), bucket_cap_mb=0.002)
            record = {"state": state, "g": {}}
            model.register_comm_hook(record, _recording_hook)
            params = list(model.parameters())
            for step in range(3):
                before = {id(p): state.residual_for(p).clone() for p in params}
                model.zero_grad()
                model(batch(rank, step)).pow(2).sum().backward()
                sent = []
                for p in params:
                    compensated = record["g"][id(p)].reshape(p.shape) + before[id(p)]
                    after = state.residual_for(p)
                    changed = after != compensated  # the sent positions, less any whose value was exact
                    assert int(changed.sum()) <= budget(p.numel(), 0.1)
                    # what left the residual is exactly the value on the wire; the rest of p stays there
                    left = torch.where(changed, compensated - after, torch.zeros_like(after))
                    assert torch.equal(left.to(state.options.wire_dtype(torch.float32)).float(), left)
                    if value_dtype is not None:  # the rounding stays: p - round(p), small against p
                        assert torch.all(after[changed].abs() <= compensated[changed].abs() * 2.0 ** -7)
                    sent.append(left.reshape(-1))
                flat_sent = torch.cat(sent)
                rows = [torch.empty_like(flat_sent) for _ in range(world)]
                dist.all_gather(rows, flat_sent)
                # the applied gradient is the mean of what the ranks sent, summed in the wire dtype
                wire = state.options.wire_dtype(torch.float32)
                mean = torch.stack([(row.to(wire) / world) for row in rows]).sum(0, dtype=torch.float32)
                grads = torch.cat([p.grad.reshape(-1) for p in params])
                tolerance = 1e-6 if value_dtype is None else 2.0 ** -6
                torch.testing.assert_close(grads, mean, rtol=tolerance, atol=1e-6)
            assert_replicas_equal(model)
            bytes_sent[(method, value_dtype)] = state.stats()["bytes_sent"]
    return bytes_sent


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_half_values_keep_their_rounding_in_the_residual_and_halve_the_value_bytes(dtype_name):
    bytes_sent = run_distributed(_rounding_kept, 2, dtype_name, timeout=300)[0]
    for method, aggregation in PATHS:
        full, half = bytes_sent[(method, None)], bytes_sent[(method, dtype_name)]
        if method == "topk":  # 4-byte values and int32 positions become 2 + 4 bytes
            assert half * 8 == full * 6, (method, full, half)
        elif method == "shared_topk":  # the leaders' positions travel as before
            assert full / 2 < half < full, (method, full, half)
        else:
            assert half * 2 == full, (method, full, half)
