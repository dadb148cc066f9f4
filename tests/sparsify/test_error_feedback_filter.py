"""ScaleCom's low-pass filter on the error-feedback memory: e' = (1 - beta) e + beta (p - c)."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import SparsifyState, sparsify_hook
from ddp_hooks.sparsify.compressor import PendingExchange, SparseCompressor
from ddp_hooks.sparsify.options import SparsifyOptions
from ddp_hooks.testing import run_distributed


def test_the_fold_filters_the_memory():
    e = torch.tensor([1.0, 2.0, 3.0, 4.0])
    before = e.clone()
    g = torch.tensor([0.5, 0.5, 0.5, 0.5])
    sent_at = torch.tensor([1, 3])
    pending = PendingExchange(grad=g.clone(), starts=torch.tensor([0]), marks=None, residual=e, velocity=None,
                              decay=None, momentum=0.0, scale=None, request=None, choice=None, dense=False,
                              shared=True, positions=sent_at, residual_before=before.index_select(0, sent_at))
    SparseCompressor(SparsifyOptions()).fold(pending, discard=torch.tensor(False), beta=0.75)
    p = before + g
    c = torch.zeros(4).index_copy_(0, sent_at, p.index_select(0, sent_at))
    assert torch.allclose(e, 0.25 * before + 0.75 * (p - c))


def test_beta_is_checked_and_needs_error_feedback():
    with pytest.raises(ValueError, match=r"`error_feedback_beta` must be a float in \(0, 1\], got 1.5"):
        SparsifyState(error_feedback_beta=1.5)
    with pytest.raises(ValueError, match="needs `error_feedback`=True"):
        SparsifyState(error_feedback_beta=0.9, error_feedback=False)
    with pytest.raises(ValueError, match="saved with .*error_feedback_beta=1, .* but .*error_feedback_beta=0.9"):
        SparsifyState(error_feedback_beta=0.9).load_state_dict(SparsifyState().state_dict())


def _filtered_residual(rank, world, beta):
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(10, 1, bias=False))
    state = SparsifyState(method="topk", aggregation="allgather", density=0.3, density_warmup_steps=0,
                          error_feedback_beta=beta)
    model.register_comm_hook(state, sparsify_hook)
    expected = torch.zeros(10)
    for step in range(4):
        x = torch.randn(4, 10, generator=torch.Generator().manual_seed(step))
        w = model.module.weight.detach().clone()
        model.zero_grad()
        model(x).sum().backward()
        g = x.sum(0)  # d/dw of sum(x w^T)
        p = g + expected
        c = torch.zeros(10)
        top = torch.topk(p.abs(), 3).indices
        c[top] = p[top]
        expected = (1 - beta) * expected + beta * (p - c)
        assert torch.allclose(model.module.weight.grad.reshape(-1), c, atol=1e-6)
        assert torch.equal(w, model.module.weight.detach())  # (no optimizer: only the gradient is checked)
    return torch.allclose(state.residual_for(model.module.weight).reshape(-1), expected, atol=1e-5)


@pytest.mark.parametrize("beta", [1.0, 0.6])
def test_the_hook_keeps_the_filtered_memory(beta):
    assert run_distributed(_filtered_residual, 1, beta) == [True]
