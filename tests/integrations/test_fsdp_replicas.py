"""FSDP2's replicas through the compressor (SparseReplicas): 4 gloo ranks, a 2 x 2 mesh (replicate x shard)."""

import pytest
import torch
import torch.distributed as dist

from ddp_hooks.testing import run_distributed

pytest.importorskip("torch.distributed.fsdp")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))  # 33, 5: padded


def _sharded(mesh, dims):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh[dims] if isinstance(dims, str) else mesh)
    fully_shard(model, mesh=mesh[dims] if isinstance(dims, str) else mesh)
    return model


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)


def _train(model, optimizer, rank, start, stop):
    losses = []
    for step in range(start, stop):
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _local(model):
    return torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])


def _dense_equals_hsdp(rank, world):
    from ddp_hooks.integrations.fsdp import SparseReplicas

    mesh = _mesh()
    hsdp = _sharded(mesh, None)  # FSDP2's own HSDP: 2-D mesh, dense all-reduce between replicas
    ours = _sharded(mesh, "shard")
    SparseReplicas(ours, mesh.get_group("replicate"), density=0.5, warmup_steps=100)  # every entry sent
    for model in (hsdp, ours):
        _train(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, 0, 3)
    return max((a.full_tensor() - b.full_tensor()).abs().max().item()
               for a, b in zip(hsdp.parameters(), ours.parameters()))


def test_sending_every_entry_is_fsdp2s_own_hsdp():
    assert max(run_distributed(_dense_equals_hsdp, 4, timeout=120)) < 1e-6


def _momentum_in_sends_at_density_one(rank, world):
    from ddp_hooks.integrations.fsdp import SparseReplicas

    mesh = _mesh()
    hsdp, ours = _sharded(mesh, None), _sharded(mesh, "shard")
    hsdp_sgd, our_sgd = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (hsdp, ours))
    SparseReplicas(ours, mesh.get_group("replicate"), optimizer=our_sgd, density=1.0, density_warmup_steps=0)
    _train(hsdp, hsdp_sgd, rank, 0, 5)
    _train(ours, our_sgd, rank, 0, 5)
    return max((a.full_tensor() - b.full_tensor()).abs().max().item()
               for a, b in zip(hsdp.parameters(), ours.parameters()))


def test_momentum_in_sends_at_density_one_is_momentum_sgd_with_fsdp2s_hsdp():
    # the velocity steps at every position, the replicas average it, the optimizer gets u_t - m u_(t-1)
    assert max(run_distributed(_momentum_in_sends_at_density_one, 4, timeout=120)) < 1e-5


def _sparse(rank, world, method, aggregation):
    from ddp_hooks.integrations.fsdp import SparseReplicas

    mesh = _mesh()
    model = _sharded(mesh, "shard")
    replicas = SparseReplicas(model, mesh.get_group("replicate"), method=method, aggregation=aggregation,
                              density=0.1, density_warmup_steps=0)
    losses = _train(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, 0, 30)
    mine = _local(model)
    rows = torch.empty(2, mine.numel())
    dist.all_gather_into_tensor(rows.view(-1), mine, group=mesh.get_group("replicate"))
    residual_entries = sum(r.numel() for r in replicas.compressor.residuals.state().values())
    return torch.equal(rows[0], rows[1]), residual_entries, losses[0], min(losses)


@pytest.mark.parametrize("method, aggregation", [("random_block", "allreduce"), ("topk", "allgather"),
                                                 ("shared_topk", "allreduce")])
def test_replicas_stay_equal_with_a_shard_of_the_residuals(method, aggregation):
    # each parameter's half, in whole rows padded as FSDP2 pads them: 391 of the model's 731 entries
    half = sum(-(-p.shape[0] // 2) * p[0].numel() if p.dim() > 1 else -(-p.numel() // 2) for p in _model().parameters())
    for equal, residual_entries, first, best in run_distributed(_sparse, 4, method, aggregation, timeout=120):
        assert equal
        assert residual_entries == half == 391
        assert best < first


def _resume(rank, world, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ddp_hooks.integrations.fsdp import SparseReplicas

    def build():
        mesh = _mesh()
        model = _sharded(mesh, "shard")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        replicas = SparseReplicas(model, mesh.get_group("replicate"), optimizer, method="random_block",
                                  density=0.1, density_warmup_steps=0, value_dtype="float16")
        return model, replicas, optimizer

    def state(model, replicas, optimizer):
        model_state, optimizer_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optimizer_state, "replicas": replicas.state_dict()}

    model, _, optimizer = build()
    _train(model, optimizer, rank, 0, 6)
    straight = _local(model)
    model, replicas, optimizer = build()
    _train(model, optimizer, rank, 0, 3)
    dcp.save(state(model, replicas, optimizer), checkpoint_id=folder)
    model, replicas, optimizer = build()
    loaded = state(model, replicas, optimizer)
    dcp.load(loaded, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    replicas.load_state_dict(loaded["replicas"])
    assert replicas.steps == [3, 3] and replicas.compressor.residuals.total() != 0 and replicas.last_update
    _train(model, optimizer, rank, 3, 6)
    return torch.equal(straight, _local(model))


def test_resume_through_distributed_checkpoint_is_bitwise(tmp_path):
    assert run_distributed(_resume, 4, str(tmp_path), timeout=120) == [True] * 4


def test_options_it_cannot_serve_are_refused():
    from ddp_hooks.integrations.fsdp import SparseReplicas

    with pytest.raises(ValueError, match="does not take `momentum`"):
        SparseReplicas(torch.nn.Linear(2, 2), None, momentum=0.9)
    with pytest.raises(ValueError, match="needs a model sharded by FSDP2"):
        SparseReplicas(torch.nn.Linear(2, 2), None)
    linear = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="must be the torch.optim.SGD"):
        SparseReplicas(linear, None, torch.optim.Adam(linear.parameters()))
    with pytest.raises(ValueError, match="nesterov=True, dampening=0"):
        SparseReplicas(linear, None, torch.optim.SGD(linear.parameters(), lr=0.1, momentum=0.9, nesterov=True))
