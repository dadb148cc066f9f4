"""Misconfigured jobs end in one clear error on every rank, never in a hang or averaged garbage (2 gloo ranks)."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_hooks import (AdaAlterAverager, LocalAdaAlter, LocalSGDState, OuterSGD, SparsifyState,
                       build_local_adaalter, local_sgd_hook, sparsify_hook)
from ddp_hooks.testing import run_distributed


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _loss(model, rank):
    g = torch.Generator().manual_seed(rank)
    return model(torch.randn(5, 6, generator=g)).pow(2).mean()


def _error(fn):
    try:
        fn()
    except Exception as exc:  # the same type and text must come out on every rank
        return type(exc).__name__, str(exc)
    return None


def _backward(model, rank):
    return lambda: _loss(model, rank).backward()


def _train_step(model, opt, rank):
    def step():
        _loss(model, rank).backward()
        opt.step()
    return step


def _cases(rank, world):
    out = {}
    # A group whose backend moves only CUDA tensors, with CPU gradients.
    cuda_only = dist.new_group(backend="cuda:gloo")
    for name, state, hook in (("sparsify_backend", SparsifyState(process_group=cuda_only), sparsify_hook),
                              ("local_sgd_backend", LocalSGDState(process_group=cuda_only), local_sgd_hook)):
        model = DDP(_model())
        model.register_comm_hook(state, hook)
        out[name] = _error(_backward(model, rank))

    # Local AdaAlter: hook and optimizer built with another period on rank 1 (found at the hook's first call).
    model = DDP(_model())
    _, opt = build_local_adaalter(model, lr=0.5, eps=1.0, period=2 + rank, warmup_steps=0)
    out["period"] = _error(_train_step(model, opt, rank))

    # Another learning rate, no Local SGD hook at all (found at the optimizer's first step).
    model = DDP(_model())
    opt = LocalAdaAlter(model.parameters(), lr=0.5 if rank == 0 else 0.25, eps=1.0, period=2)
    out["lr"] = _error(_train_step(model, opt, rank))

    # Another lazy correction, another outer optimizer.
    model = DDP(_model())
    _, opt = build_local_adaalter(model, lr=0.5, period=2, lazy_correction="rate" if rank == 0 else "paper")
    out["rule"] = _error(_train_step(model, opt, rank))
    model = DDP(_model())
    _, opt = build_local_adaalter(model, lr=0.5, period=2, outer_lr=0.7, outer_momentum=[0.9, 0.5][rank])
    out["outer"] = _error(_train_step(model, opt, rank))

    # Ranks resumed from checkpoints of different steps.
    model = DDP(_model())
    hook_state, opt = build_local_adaalter(model, lr=0.5, eps=1.0, period=4, warmup_steps=1)
    opt.load_state_dict({**opt.state_dict(), "schedule": {"warmup_steps": 1, "period": 4, "step": 3 + rank,
                                                          "last_sync": 1}})
    out["resumed_steps"] = _error(_train_step(model, opt, rank))

    # PyTorch-style periodic averaging with plain SGD and different periods.
    model = DDP(_model())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = AdaAlterAverager(period=3 + rank)
    out["averager_period"] = _error(lambda: (_train_step(model, sgd, rank)(),
                                             averager.average_parameters(model.parameters())))
    model = DDP(_model())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = AdaAlterAverager(period=3, outer=OuterSGD(lr=[0.7, 0.5][rank]))
    out["averager_outer"] = _error(lambda: (_train_step(model, sgd, rank)(),
                                            averager.average_parameters(model.parameters())))

    # A GradScaler given to one rank's SparsifyState only.
    model = DDP(_model())
    scaler = torch.amp.GradScaler("cpu") if rank == 0 else None
    model.register_comm_hook(SparsifyState(grad_scaler=scaler), sparsify_hook)
    out["grad_scaler"] = _error(_backward(model, rank))

    # The process group destroyed while training goes on.
    fresh = []
    for state, hook in ((SparsifyState(), sparsify_hook), (LocalSGDState(warmup_steps=1), local_sgd_hook)):
        model = DDP(_model())
        model.register_comm_hook(state, hook)
        fresh.append(model)
    dist.destroy_process_group()
    out["sparsify_no_group"], out["local_sgd_no_group"] = [_error(_backward(m, rank)) for m in fresh]
    return out


EXPECTED = {
    "sparsify_backend": ("RuntimeError", "sparsify_hook: the gradients are on cpu but the process group's backend "
                                         "('cuda:gloo') only moves cuda tensors"),
    "local_sgd_backend": ("RuntimeError", "local_sgd_hook: the gradients are on cpu but the process group's backend "
                                          "('cuda:gloo') only moves cuda tensors"),
    "period": ("ValueError", "ranks were built with different Local AdaAlter settings: rank 0 has period=2 but "
                             "rank 1 has period=3; build every rank's optimizer and hook from the same numbers"),
    "lr": ("ValueError", "ranks were built with different Local AdaAlter settings"),
    "resumed_steps": ("ValueError", "rank 0 has step=3 but rank 1 has step=4; "),
    "averager_period": ("ValueError", "rank 0 has period=3 but rank 1 has period=4; "),
    "rule": ("ValueError", "rank 0 has lazy_correction=2, groups_crc32="),
    "outer": ("ValueError", "rank 0 has outer_momentum=0.9 but rank 1 has outer_momentum=0.5"),
    "averager_outer": ("ValueError", "ranks were built with different outer optimizers: rank 0 has outer_lr=0.7 but "
                                     "rank 1 has outer_lr=0.5; every rank must take the same outer"),
    "grad_scaler": ("ValueError", "ranks were built with different SparsifyState options"),
    "sparsify_no_group": ("RuntimeError", "sparsify_hook was called but torch.distributed has no process group; "
                                          "call torch.distributed.init_process_group before training"),
    "local_sgd_no_group": ("RuntimeError", "local_sgd_hook was called but torch.distributed has no process group"),
}


def test_misconfigurations_raise_one_clear_error_on_every_rank():
    results = run_distributed(_cases, 2, timeout=120)
    for name, (kind, text) in EXPECTED.items():
        errors = [r[name] for r in results]
        assert errors[0] is not None and errors[0][0] == kind and text in errors[0][1], (name, errors[0])
        if name not in ("sparsify_no_group", "local_sgd_no_group"):  # these do not depend on the other rank
            assert errors[0] == errors[1], (name, errors)
    lr_message = results[0]["lr"][1]
    assert "rank 0 has lr=0.5, groups_crc32=" in lr_message and "rank 1 has lr=0.25, groups_crc32=" in lr_message
    assert "grad_scaler=given" in results[0]["grad_scaler"][1]
