"""HSDP whose all-reduce between replicas is sparse: FSDP2 and ``SparseReplicas`` in a training loop.

A small CNN on Fashion-MNIST, sharded over ``--shard-size`` ranks and
replicated over the rest (a 2-D mesh, as on nodes of that many GPUs); every
rank reads its own part of the training images. ``--replicas dense`` is
FSDP2's own HSDP, ``sparse`` sends each shard's gradient between replicas
through the sparsifying compressor. Checkpoints go through
``torch.distributed.checkpoint`` at every epoch, each rank writing its own
model shards and residuals (``--checkpoint-dir``; ``--resume`` continues)::

    torchrun --nproc-per-node 4 recipes/fsdp_replicas.py --replicas sparse --method random_block --density 0.01
    torchrun --nproc-per-node 4 recipes/fsdp_replicas.py --replicas dense

Data: Debian's ``dataset-fashion-mnist`` (``--data-dir`` for another copy).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cifar_models import small_cnn  # noqa: E402
from fashion_mnist_data import find_fashion_mnist, read_fashion_mnist  # noqa: E402


def sharded_model(args, world: int):
    """The CNN under FSDP2 on a (replicate, shard) mesh (2-D for ``--replicas dense``: FSDP2's HSDP), and the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if world % args.shard_size:
        raise SystemExit(f"--shard-size {args.shard_size} must divide the world size {world}")
    mesh = init_device_mesh("cpu", (world // args.shard_size, args.shard_size), mesh_dim_names=("replicate", "shard"))
    model = small_cnn(args.seed)
    over = mesh if args.replicas == "dense" else mesh["shard"]  # dense: FSDP2's own HSDP
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=over)
    fully_shard(model, mesh=over)
    return model, mesh


def train(rank: int, world: int, args) -> dict:
    """Train on this rank's part of the images; the test accuracy after each epoch (every rank evaluates)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.set_num_threads(1)
    train_x, train_y, test_x, test_y = read_fashion_mnist(find_fashion_mnist(args.data_dir))
    scale = lambda x: ((x.float() / 255.0 - 0.2860) / 0.3530).unsqueeze(1)  # noqa: E731 (the data set's mean, std)
    per_rank = args.train // world
    xs, ys = scale(train_x[rank * per_rank:(rank + 1) * per_rank]), train_y[rank * per_rank:(rank + 1) * per_rank]
    test_x, steps_per_epoch = scale(test_x), per_rank // args.batch
    from ddp_hooks.integrations.fsdp import SparseReplicas

    model, mesh = sharded_model(args, world)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    replicas = None  # the one added line: the replicas' all-reduce through the compressor, momentum counted in sends
    if args.replicas == "sparse":
        replicas = SparseReplicas(model, mesh.get_group("replicate"), optimizer, method=args.method,
                                  density=args.density, seed=args.seed)
    start_epoch, curve = 0, []

    def state():
        model_state, optimizer_state = get_state_dict(model, optimizer)
        out = {"model": model_state, "optimizer": optimizer_state,
               "progress": {"epoch": torch.tensor(0), "curve": torch.zeros(args.epochs)}}
        if replicas is not None:
            out["replicas"] = replicas.state_dict()
        return out

    if args.resume and os.path.exists(os.path.join(args.checkpoint_dir or "", ".metadata")):
        loaded = state()
        dcp.load(loaded, checkpoint_id=args.checkpoint_dir)
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
        if replicas is not None:
            replicas.load_state_dict(loaded["replicas"])
        start_epoch = int(loaded["progress"]["epoch"])
        curve = [round(v, 2) for v in loaded["progress"]["curve"][:start_epoch].tolist()]
    begin = time.perf_counter()
    stop = args.epochs if args.stop_after is None else min(args.epochs, args.stop_after)
    for epoch in range(start_epoch, stop):
        order = torch.randperm(per_rank, generator=torch.Generator().manual_seed(10_000 * args.seed + 100 * rank + epoch))
        for i in range(steps_per_epoch):
            step = epoch * steps_per_epoch + i
            for group in optimizer.param_groups:  # cosine decay
                group["lr"] = args.lr * 0.5 * (1.0 + math.cos(math.pi * step / (args.epochs * steps_per_epoch)))
            batch = order[i * args.batch:(i + 1) * args.batch]
            loss = torch.nn.functional.cross_entropy(model(xs[batch]), ys[batch])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            correct = sum(int((model(test_x[i:i + 2000]).argmax(1) == test_y[i:i + 2000]).sum())
                          for i in range(0, len(test_y), 2000))
        curve.append(round(100.0 * correct / len(test_y), 2))
        if rank == 0:
            print(f"epoch {epoch + 1}: test accuracy {curve[-1]:.2f} %, loss {loss.item():.3f}", flush=True)
        if args.checkpoint_dir:
            saved = state()
            saved["progress"] = {"epoch": torch.tensor(epoch + 1),
                                 "curve": torch.tensor(curve + [0.0] * (args.epochs - len(curve)))}
            dcp.save(saved, checkpoint_id=args.checkpoint_dir)
    weights = float(sum(p.full_tensor().double().sum() for p in model.parameters()))  # (a collective)
    if rank == 0:
        print(f"after {len(curve)} epochs: curve {curve}, sum of the weights {weights!r}", flush=True)
    return {"accuracy": curve[-1] if curve else None, "curve": curve, "seconds": time.perf_counter() - begin,
            "last_loss": loss.item() if stop > start_epoch else None}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", choices=("sparse", "dense"), default="sparse",
                   help="the all-reduce between replicas: through the compressor, or FSDP2's own (default: sparse)")
    p.add_argument("--method", default="random_block", help="sparse: the selector (default: random_block)")
    p.add_argument("--density", type=float, default=0.01, help="sparse: fraction of entries sent (default: 0.01)")
    p.add_argument("--shard-size", type=int, default=2, help="ranks that share one copy of the model (default: 2)")
    p.add_argument("--epochs", type=int, default=2, help="epochs (default: 2)")
    p.add_argument("--train", type=int, default=12000, help="training images, split over the ranks (default: 12000)")
    p.add_argument("--batch", type=int, default=32, help="images per rank per step (default: 32)")
    p.add_argument("--lr", type=float, default=0.05, help="peak learning rate, cosine decay (default: 0.05)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order (default: 0)")
    p.add_argument("--data-dir", default=None, help="Fashion-MNIST folder (default: Debian's)")
    p.add_argument("--checkpoint-dir", default=None, help="save through torch.distributed.checkpoint every epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir if it holds a checkpoint")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this many epochs (to resume later)")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    code = 0
    try:
        train(dist.get_rank(), dist.get_world_size(), args)
    except BaseException:  # noqa: BLE001 - printed, then the process ends with status 1
        traceback.print_exc()
        code = 1
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # gloo's teardown aborts now and then at interpreter exit


if __name__ == "__main__":
    main()
