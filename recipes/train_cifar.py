"""Train a ResNet on CIFAR-10, Fashion-MNIST or a synthetic look-alike with DDP and a communication hook.

One process per GPU (NCCL) or per CPU slot (gloo), started by torchrun::

    torchrun --standalone --nproc_per_node=2 recipes/train_cifar.py --data synthetic --hook sparsify
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        recipes/train_cifar.py --data cifar10 --data-dir ~/data --hook powersgd --model resnet18
    torchrun --standalone --nproc_per_node=2 recipes/train_cifar.py --data fashion-mnist --hook sparsify

``--data fashion-mnist`` reads Debian's ``dataset-fashion-mnist`` files (or
``--data-dir``), see ``fashion_mnist_data.py``.

Without torchrun it runs as a single process. Invalid flags and flag
combinations are refused by :func:`validate_args` before any process group
starts, in one line printed by rank 0 alone (torchrun then reports its failed
processes).

Every epoch writes, under ``--out-dir``: one JSON line in ``metrics.jsonl``
(see ``run_metrics.TIME_FIELDS``) and one checkpoint per rank,
``checkpoint-rank{R}.pt`` (model, optimizer, hook state with this rank's
error-feedback residuals, AMP scaler, epoch, step, RNG states); the one
before it stays as ``checkpoint-rank{R}.prev.pt``. ``--resume`` continues
from the latest epoch whose checkpoint every rank has, on the same number of
ranks: N epochs, or K epochs + resume + N-K epochs, give bitwise the same
parameters on CPU, also after a run killed at any moment (mid-epoch, or
between two ranks' saves).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

from ddp_hooks.sparsify.selectors import selector_class, selector_names

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helper modules beside this file

from cifar_data import augment, load_cifar10, make_synthetic  # noqa: E402
from cifar_models import MODELS, build_model  # noqa: E402
from comm_setup import HOOKS, OPTIMIZERS, SYNC_SELECTORS, build_exchange, build_optimizer  # noqa: E402
from fashion_mnist_data import DEBIAN_FOLDER, load_fashion_mnist  # noqa: E402
from run_metrics import MetricsFile, PhaseTimer, format_bytes, summary_table  # noqa: E402

logger = logging.getLogger("train_cifar")

CHECKPOINT_VERSION = 1
# Options that only one choice of another option uses: (owner flag, owner value, default).
# They default to None so that giving one with another owner is refused, not ignored.
_OWNED_OPTIONS = {
    "method": ("hook", "sparsify", "random_block"),
    "density": ("hook", "sparsify", 0.01),
    "scope": ("hook", "sparsify", "layer"),
    "aggregation": ("hook", "sparsify", "allreduce"),
    "block_size": ("hook", "sparsify", 4),
    "density_warmup_steps": ("hook", "sparsify", None),  # None: the hook's default (1000)
    "density_warmup_start": ("hook", "sparsify", None),  # None: the hook's default (1)
    "value_dtype": ("hook", "sparsify", None),  # None: the gradient's dtype
    "nodes": ("hook", "sparsify", None),  # None: flat, every rank with every other
    "powersgd_rank": ("hook", "powersgd", 1),
    "period": ("optimizer", "local_adaalter", 8),
    "lazy_correction": ("optimizer", "local_adaalter", None),  # None: the optimizer's default
    "outer_lr": ("optimizer", "local_adaalter", 1.0),
    "outer_momentum": ("optimizer", "local_adaalter", 0.0),
    "sync": ("optimizer", "local_adaalter", "dense"),
    "sync_density": ("optimizer", "local_adaalter", 0.01),
    "accumulator_period": ("optimizer", "local_adaalter", 0),  # 0: every --period steps
    "compress_accumulators": ("optimizer", "local_adaalter", False),
    "momentum": ("optimizer", "sgd", 0.9),
}
_ADAGRAD_EPS = {"adagrad": 1e-10, "local_adaalter": 1.0}
# Run settings compared on --resume that checkpoints written before them lack, with the values they ran with.
_CONFIG_ADDED_LATER = {"lazy_correction": "paper", "outer_lr": 1.0, "outer_momentum": 0.0, "sync": "dense",
                       "sync_density": 0.01, "accumulator_period": 0, "compress_accumulators": False}


class _OncePerJobParser(argparse.ArgumentParser):
    """Reports a bad flag in one line, from one process: torchrun starts every rank with the same flags,
    so only rank 0 (``RANK`` unset or 0) prints; every rank exits with status 2."""

    def error(self, message: str):
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{self.prog}: error: {message} (flags: {self.prog} --help)\n")
        sys.exit(2)


def _nodes_flag(text: str):
    """``--nodes``: ``local`` or a positive number of ranks per node."""
    if text == "local":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be 'local' or a positive number of ranks per node, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = _OncePerJobParser(description=__doc__.split("\n\n")[0],
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", choices=MODELS, default="resnet20", help="network (default: resnet20)")
    g.add_argument("--width", type=int, default=None,
                   help="channels of the first stage (default: 16 for resnet20..56, 64 for resnet18)")
    g.add_argument("--data", choices=("synthetic", "cifar10", "fashion-mnist"), default="synthetic",
                   help="data set; fashion-mnist is 28x28 greyscale, fed to the models as 3 equal channels "
                        "(default: synthetic)")
    g.add_argument("--data-dir", default=None,
                   help="cifar10: folder holding cifar-10-batches-py/ (required); fashion-mnist: folder holding "
                        "the four idx files (plain or .gz), itself or in FashionMNIST/raw/ under it "
                        f"(default: {DEBIAN_FOLDER}, from `apt-get install dataset-fashion-mnist`)")
    g.add_argument("--download", action="store_true",
                   help="download the data set into --data-dir through torchvision unless it is there already "
                        "(default: off)")
    g.add_argument("--cifar-skip-md5", action="store_true",
                   help="read cifar-10-batches-py/ directly, without torchvision's md5 check, for a local "
                        "copy or subset in the same format (default: off)")
    g.add_argument("--synthetic-size", type=int, default=5000,
                   help="training images of the synthetic set; the test set has a fifth as many (default: 5000)")
    g.add_argument("--synthetic-noise", type=float, default=4.0,
                   help="noise of the synthetic images relative to the class templates (default: 4.0)")
    g.add_argument("--image-size", type=int, default=32, help="side of the synthetic images (default: 32)")
    g.add_argument("--augment", choices=("auto", "none", "crop-flip"), default="auto",
                   help="training-image augmentation; auto is crop-flip (4-pixel random crop, random flip) for "
                        "cifar10 and fashion-mnist, and none for synthetic, whose class templates are not "
                        "shift-invariant (default: auto)")

    g = p.add_argument_group("communication hook")
    g.add_argument("--hook", choices=HOOKS, default="allreduce", help="DDP comm hook (default: allreduce)")
    g.add_argument("--method", choices=selector_names(), default=None,
                   help="sparsify: coordinate selector (default: random_block)")
    g.add_argument("--density", type=float, default=None,
                   help="sparsify: fraction of entries sent, in (0, 1] (default: 0.01)")
    g.add_argument("--block-size", type=int, default=None,
                   help="sparsify, random_block: entries per block (default: 4)")
    g.add_argument("--density-warmup-steps", type=int, default=None,
                   help="sparsify: steps over which the density falls to --density (default: 1000)")
    g.add_argument("--density-warmup-start", type=float, default=None,
                   help="sparsify: the density the warm-up falls from, in (0, 1] (default: 1)")
    g.add_argument("--value-dtype", choices=("float16", "bfloat16", "float32"), default=None,
                   help="sparsify: dtype the sent values travel in; the rounding stays in the residual "
                        "(default: the gradient's)")
    g.add_argument("--nodes", type=_nodes_flag, default=None,
                   help="sparsify: dense inside nodes, sparse between them: 'local' (LOCAL_WORLD_SIZE ranks per "
                        "node, as torchrun starts them) or the ranks per node (default: flat)")
    g.add_argument("--scope", choices=("layer", "bucket", "global"), default=None,
                   help="sparsify: unit that gets its own budget (default: layer)")
    g.add_argument("--aggregation", choices=("allreduce", "allgather"), default=None,
                   help="sparsify: how ranks combine entries; topk needs allgather (default: allreduce)")
    g.add_argument("--no-error-feedback", action="store_true",
                   help="sparsify: drop what was not sent instead of adding it next step (default: keep it)")
    g.add_argument("--warmup-steps", type=int, default=None,
                   help="dense steps before the hook compresses (sparsify, powersgd) or goes local (local_sgd, "
                        "local_adaalter) (default: 0; 2 for powersgd, its minimum)")
    g.add_argument("--hook-seed", type=int, default=0, help="seed of the random selectors (default: 0)")
    g.add_argument("--powersgd-rank", type=int, default=None, help="powersgd: rank of the approximation (default: 1)")

    g = p.add_argument_group("optimization")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd", help="optimizer (default: sgd)")
    g.add_argument("--period", type=int, default=None,
                   help="local_adaalter: steps between model averagings (default: 8)")
    g.add_argument("--lazy-correction", choices=("paper", "constant", "rate"), default=None,
                   help="local_adaalter: the denominator's placeholder during local steps (default: the "
                        "optimizer's, see README)")
    g.add_argument("--outer-lr", type=float, default=None,
                   help="local_adaalter: outer optimizer's learning rate at each averaging (default: 1, with "
                        "--outer-momentum 0 plain averaging; DiLoCo: 0.7)")
    g.add_argument("--outer-momentum", type=float, default=None,
                   help="local_adaalter: outer optimizer's Nesterov momentum (default: 0; DiLoCo: 0.9)")
    g.add_argument("--sync", choices=("dense",) + SYNC_SELECTORS, default=None,
                   help="local_adaalter: what a synchronisation sends: 'dense' (the parameters, the default) or "
                        "each rank's pseudo-gradient through this selector, with error feedback")
    g.add_argument("--sync-density", type=float, default=None,
                   help="local_adaalter with a sparse --sync: fraction of each parameter sent (default: 0.01)")
    g.add_argument("--accumulator-period", type=int, default=None,
                   help="local_adaalter: average the accumulators every this many steps, a multiple of --period "
                        "(default: --period)")
    g.add_argument("--compress-accumulators", action="store_const", const=True, default=None,
                   help="local_adaalter with a sparse --sync: send the accumulators sparsely too")
    g.add_argument("--epochs", type=int, default=2, help="epochs (default: 2)")
    g.add_argument("--stop-after", type=int, default=None,
                   help="end after this many epochs in all, keeping the schedule of --epochs, to split one run "
                        "into several jobs continued with --resume (default: --epochs)")
    g.add_argument("--batch-size", type=int, default=64, help="images per process per step (default: 64)")
    g.add_argument("--lr", type=float, default=0.1, help="peak learning rate (default: 0.1)")
    g.add_argument("--lr-schedule", choices=("constant", "cosine", "step"), default="cosine",
                   help="decay after warm-up (default: cosine)")
    g.add_argument("--lr-warmup-epochs", type=float, default=0.0,
                   help="epochs of linear learning-rate warm-up (default: 0)")
    g.add_argument("--lr-milestones", type=float, nargs="+", default=None,
                   help="step schedule: epochs at which the rate is multiplied by --lr-decay "
                        "(default: half and three quarters of --epochs)")
    g.add_argument("--lr-decay", type=float, default=0.1, help="step schedule: factor per milestone (default: 0.1)")
    g.add_argument("--momentum", type=float, default=None,
                   help="sgd: momentum (default: 0.9); with --hook sparsify, a random --method and error feedback, "
                        "momentum and --weight-decay run in the hook and SGD gets neither (random selectors diverge "
                        "under SGD's own momentum)")
    g.add_argument("--weight-decay", type=float, default=5e-4, help="L2 weight decay (default: 5e-4)")
    g.add_argument("--eps", type=float, default=None,
                   help="adagrad/local_adaalter: epsilon (default: 1e-10 for adagrad, 1.0 for local_adaalter)")
    g.add_argument("--seed", type=int, default=0, help="seed of the model, data order and augmentation (default: 0)")

    g = p.add_argument_group("system")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to train; auto picks cuda when available (default: auto)")
    g.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="process group backend; auto is nccl on cuda, gloo on cpu (default: auto)")
    g.add_argument("--amp", action="store_true", help="float16 mixed precision, cuda only (default: off)")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (default: torch's choice divided by the local processes)")
    g.add_argument("--out-dir", default=None,
                   help="folder for metrics.jsonl and per-rank checkpoints (default: none, nothing written)")
    g.add_argument("--resume", action="store_true", help="continue from the checkpoints in --out-dir (default: off)")
    g.add_argument("--log-every", type=int, default=20, help="steps between progress lines (default: 20)")
    return p


def resolve_device(args, cuda_available: bool) -> str:
    """``'cuda'`` or ``'cpu'`` from ``--device``."""
    if args.device == "auto":
        return "cuda" if cuda_available else "cpu"
    return args.device


def resolve_backend(args, device: str) -> str:
    if args.backend == "auto":
        return "nccl" if device == "cuda" else "gloo"
    return args.backend


def validate_args(args, cuda_available: bool) -> None:
    """Refuse invalid flag combinations with ``ValueError``; fill in the defaults of owned options.

    Pure: no process group, no data, no devices touched (``cuda_available``
    is passed in), so it runs before anything starts and in tests.
    """
    for name, (owner, value, default) in _OWNED_OPTIONS.items():
        if getattr(args, name) is None:
            if getattr(args, owner) == value:
                setattr(args, name, default)
        elif getattr(args, owner) != value:
            raise ValueError(f"--{name.replace('_', '-')} applies to --{owner} {value} only, "
                             f"not --{owner} {getattr(args, owner)}")
    if args.no_error_feedback and args.hook != "sparsify":
        raise ValueError(f"--no-error-feedback applies to --hook sparsify only, not --hook {args.hook}")
    if (args.optimizer == "local_adaalter") != (args.hook == "local_sgd"):
        raise ValueError("--optimizer local_adaalter and --hook local_sgd go together: the hook skips the "
                         "gradient exchange after warm-up and the optimizer averages the models every --period "
                         f"steps; got --hook {args.hook} with --optimizer {args.optimizer}")
    if args.eps is None:
        args.eps = _ADAGRAD_EPS.get(args.optimizer)
    elif args.optimizer not in _ADAGRAD_EPS:
        raise ValueError(f"--eps applies to --optimizer adagrad or local_adaalter only, not {args.optimizer}")
    if args.hook == "sparsify":
        if not 0.0 < args.density <= 1.0:
            raise ValueError(f"--density must be in (0, 1]: it is the fraction of entries sent, got {args.density}")
        selector = selector_class(args.method)
        if args.aggregation not in selector.aggregations:
            raise ValueError(f"--method {args.method} needs --aggregation {' or '.join(selector.aggregations)}: "
                             f"{selector.aggregation_reason}")
    if args.optimizer == "local_adaalter":
        if not args.outer_lr > 0.0:
            raise ValueError(f"--outer-lr must be > 0: it is the outer optimizer's learning rate, got {args.outer_lr}")
        if not 0.0 <= args.outer_momentum < 1.0:
            raise ValueError("--outer-momentum must be in [0, 1): it is the outer optimizer's momentum factor, "
                             f"got {args.outer_momentum}")
        if not 0.0 < args.sync_density <= 1.0:
            raise ValueError(f"--sync-density must be in (0, 1]: it is the fraction of each parameter a "
                             f"synchronisation sends, got {args.sync_density}")
        if args.accumulator_period < 0 or args.accumulator_period % args.period:
            raise ValueError(f"--accumulator-period must be a positive multiple of --period {args.period} (or 0: "
                             f"--period): the accumulators are averaged at a synchronisation, got "
                             f"{args.accumulator_period}")
        if args.compress_accumulators and args.sync == "dense":
            raise ValueError("--compress-accumulators needs a sparse --sync: it sends the accumulators through "
                             "the same selector")
    if args.hook == "powersgd":
        if args.powersgd_rank < 1:
            raise ValueError(f"--powersgd-rank must be >= 1, got {args.powersgd_rank}")
        if args.warmup_steps is not None and args.warmup_steps < 2:
            raise ValueError("--hook powersgd needs --warmup-steps >= 2: PowerSGD with error feedback can only "
                             "start after DDP rebuilt its buckets at the end of the first step")
    for name, low in (("epochs", 1), ("stop_after", 1), ("batch_size", 1), ("log_every", 1), ("synthetic_size", 1),
                      ("image_size", 8), ("period", 1), ("warmup_steps", 0), ("threads", 1), ("width", 1),
                      ("block_size", 1), ("density_warmup_steps", 0)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    for name in ("lr", "eps"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name} must be > 0, got {value}")
    if args.weight_decay < 0 or args.lr_warmup_epochs < 0 or args.synthetic_noise < 0:
        raise ValueError("--weight-decay, --lr-warmup-epochs and --synthetic-noise must be >= 0")
    if args.lr_milestones is not None and args.lr_schedule != "step":
        raise ValueError(f"--lr-milestones applies to --lr-schedule step only, not {args.lr_schedule}")
    if args.data == "cifar10":
        if args.data_dir is None:
            raise ValueError("--data cifar10 needs --data-dir (the folder that holds or receives cifar-10-batches-py/)")
        if args.download and args.cifar_skip_md5:
            raise ValueError("--download and --cifar-skip-md5 exclude each other: downloads are md5-checked")
        if args.image_size != 32:
            raise ValueError("--image-size applies to --data synthetic only: CIFAR-10 images are 32x32")
    elif args.data == "fashion-mnist":
        if args.download and args.data_dir is None:
            raise ValueError("--data fashion-mnist --download needs --data-dir, the folder that receives "
                             f"FashionMNIST/raw/; without --download, {DEBIAN_FOLDER} is read")
        if args.cifar_skip_md5:
            raise ValueError("--cifar-skip-md5 applies to --data cifar10 only, not --data fashion-mnist")
        if args.image_size != 32:
            raise ValueError("--image-size applies to --data synthetic only: Fashion-MNIST images are 28x28")
    elif args.download or args.cifar_skip_md5 or args.data_dir is not None:
        raise ValueError("--data-dir, --download and --cifar-skip-md5 apply to --data cifar10 only (--data-dir and "
                         "--download to fashion-mnist too), not to --data synthetic, which reads no files")
    if args.stop_after is not None and args.stop_after > args.epochs:
        raise ValueError(f"--stop-after {args.stop_after} exceeds --epochs {args.epochs}")
    if args.resume and args.out_dir is None:
        raise ValueError("--resume needs --out-dir, the folder holding the checkpoints")
    device = resolve_device(args, cuda_available)
    if device == "cuda" and not cuda_available:
        raise ValueError("--device cuda, but no CUDA device is available")
    if args.amp and device != "cuda":
        raise ValueError("--amp needs a CUDA device: float16 autocast on CPU is slow and unsupported here")
    if resolve_backend(args, device) == "nccl" and device != "cuda":
        raise ValueError("--backend nccl needs --device cuda")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate_args(args, torch.cuda.is_available())
    except ValueError as exc:
        parser.error(str(exc))
    return args


def lr_factor(step: int, steps_per_epoch: int, args) -> float:
    """Multiplier of ``--lr`` at ``step`` (0-based): linear warm-up, then the schedule."""
    warmup = args.lr_warmup_epochs * steps_per_epoch
    if step < warmup:
        return (step + 1) / warmup
    if args.lr_schedule == "constant":
        return 1.0
    if args.lr_schedule == "cosine":
        total = args.epochs * steps_per_epoch
        progress = (step - warmup) / max(1.0, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    milestones = args.lr_milestones or (0.5 * args.epochs, 0.75 * args.epochs)
    epoch = step / steps_per_epoch
    return args.lr_decay ** sum(epoch >= m for m in milestones)


def setup_distributed(args, device: str) -> bool:
    """Join the process group (torchrun's environment, or a one-process group); True if this call made it."""
    if dist.is_initialized():
        return False
    backend = resolve_backend(args, device)
    if "RANK" in os.environ:  # started by torchrun
        kwargs = {}
        if device == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            kwargs["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(backend, **kwargs)
    else:
        from ddp_hooks.testing import free_port

        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return True


def _device(kind: str) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _load_data(args, rank: int):
    if args.data == "synthetic":
        return (make_synthetic(args.synthetic_size, args.seed, True, args.image_size, noise=args.synthetic_noise),
                make_synthetic(max(1, args.synthetic_size // 5), args.seed, False, args.image_size,
                               noise=args.synthetic_noise))
    if args.data == "fashion-mnist":
        if not args.download:
            return load_fashion_mnist(args.data_dir)
        sets = load_fashion_mnist(args.data_dir, download=True) if rank == 0 else None
        dist.barrier()  # rank 0 downloads, then everyone reads
        return sets if sets is not None else load_fashion_mnist(args.data_dir)
    verify = not args.cifar_skip_md5
    if args.download and rank == 0:  # one download, then everyone reads it
        load_cifar10(args.data_dir, True, download=True)
    dist.barrier()
    return load_cifar10(args.data_dir, True, verify=verify), load_cifar10(args.data_dir, False, verify=verify)


class Trainer:
    """Data, DDP model, comm hook and optimizer of one rank, with epochs, evaluation and checkpoints."""

    def __init__(self, args, device: torch.device):
        self.args = args
        self.device = device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.train_set, self.test_set = _load_data(args, self.rank)
        self.augment = args.augment == "crop-flip" or (args.augment == "auto" and args.data != "synthetic")
        self.sampler = DistributedSampler(self.train_set, num_replicas=self.world_size, rank=self.rank,
                                          shuffle=True, seed=args.seed, drop_last=True)
        self.steps_per_epoch = len(self.sampler) // args.batch_size
        if self.steps_per_epoch < 1:
            raise ValueError(f"{len(self.train_set)} training images on {self.world_size} ranks make no full batch "
                             f"of {args.batch_size}: raise --synthetic-size or lower --batch-size")
        torch.manual_seed(args.seed)
        model = build_model(args.model, len(self.train_set.classes), args.width).to(device)
        self.ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
        # The sparsifier keeps its residuals unscaled when it knows the AMP loss scale.
        self.exchange = build_exchange(args, grad_scaler=self.scaler if args.amp else None)
        self.optimizer = build_optimizer(args, self.ddp.parameters(), self.exchange)
        self.timer = PhaseTimer(device)
        self.epoch = 0  # epochs done
        self.step = 0  # optimizer steps done
        if args.resume:
            self._load_snapshot()
        self._settle_buckets()
        self.exchange.register(self.ddp)
        self.metrics = None
        if args.out_dir is not None and self.rank == 0:
            self.metrics = MetricsFile(os.path.join(args.out_dir, "metrics.jsonl"), resume_epoch=self.epoch)

    # ----- checkpoints -----
    def _snapshot_path(self, rank: int, previous: bool = False) -> str:
        return os.path.join(self.args.out_dir, f"checkpoint-rank{rank}{'.prev' if previous else ''}.pt")

    def _run_config(self) -> dict:
        a = self.args
        config = {"model": a.model, "width": a.width if a.width is not None else -1, "data": a.data,
                  "hook": a.hook, "optimizer": a.optimizer, "batch_size": a.batch_size,
                  "world_size": self.world_size, "seed": a.seed}
        if a.optimizer == "local_adaalter":  # a checkpoint's param groups would silently win over the flags
            config.update(lazy_correction=self.optimizer.defaults["lazy_correction"], outer_lr=a.outer_lr,
                          outer_momentum=a.outer_momentum, sync=a.sync, sync_density=a.sync_density,
                          accumulator_period=a.accumulator_period, compress_accumulators=a.compress_accumulators)
        return config

    def _save_snapshot(self) -> None:
        snapshot = {
            "version": CHECKPOINT_VERSION,
            "config": self._run_config(),
            "epoch": self.epoch,
            "step": self.step,
            "sampler_epoch": self.sampler.epoch,
            "model": self.ddp.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "hook": self.exchange.state_dict(),
            # LocalAdaAlter keeps its averaging counter in its own state_dict
            "averager": None,
            "scaler": self.scaler.state_dict(),
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None},
        }
        os.makedirs(self.args.out_dir, exist_ok=True)
        path = self._snapshot_path(self.rank)
        torch.save(snapshot, path + ".tmp")
        if os.path.exists(path):  # a kill between two ranks' saves still leaves an epoch that every rank has
            os.replace(path, self._snapshot_path(self.rank, previous=True))
        os.replace(path + ".tmp", path)

    def _readable_snapshots(self) -> dict:
        """This rank's checkpoints that fit this run, by epoch; reasons for those that do not."""
        found, refused = {}, []
        mine = self._run_config()
        for path in (self._snapshot_path(self.rank), self._snapshot_path(self.rank, previous=True)):
            if not os.path.exists(path):
                continue
            snap = torch.load(path, map_location=self.device, weights_only=True)
            saved = {**_CONFIG_ADDED_LATER, **snap["config"]}
            diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
            if snap["version"] != CHECKPOINT_VERSION:
                refused.append(f"{path}: checkpoint version {snap['version']} is not {CHECKPOINT_VERSION}")
            elif diff:
                refused.append(f"{path} was written by another configuration (saved, now): {diff}")
            else:
                found[snap["epoch"]] = snap
        return {"found": found, "refused": refused}

    def _load_snapshot(self) -> None:
        """Load the latest epoch whose checkpoint every rank has; every rank raises alike if there is none."""
        readable = self._readable_snapshots()
        epochs = sorted(readable["found"], reverse=True)[:2]
        mine = torch.tensor(epochs + [-1] * (2 - len(epochs)), device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine)  # before any rank may raise: a rank raising alone would leave the others waiting
        held = [set(row.tolist()) - {-1} for row in rows]
        common = set.intersection(*held)
        if not common:
            raise ValueError(
                f"--resume: no epoch has a checkpoint on every rank in {self.args.out_dir} (epochs per rank: "
                f"{[sorted(h) for h in held]}); this rank: {'; '.join(readable['refused']) or 'no refused file'}"
            )
        snap = readable["found"][max(common)]
        # After DDP's construction, which copied rank 0's weights to all ranks:
        # local SGD's replicas differ, so each rank loads its own.
        self.ddp.module.load_state_dict(snap["model"])
        self.optimizer.load_state_dict(snap["optimizer"])
        self.exchange.load_state_dict(snap["hook"])
        self.scaler.load_state_dict(snap["scaler"])
        torch.set_rng_state(snap["rng"]["torch"].cpu())
        if snap["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(snap["rng"]["cuda"].cpu(), self.device)
        self.epoch, self.step = snap["epoch"], snap["step"]
        logger.info("resumed from %s at epoch %d (step %d)", self.args.out_dir, self.epoch, self.step)

    # ----- training -----
    def _settle_buckets(self) -> None:
        """One forward and backward before training, with nothing kept, so DDP fixes its bucket layout now.

        DDP rebuilds its buckets in gradient-ready order after its first
        backward. A resumed run would otherwise take its first step in the
        initial layout while the hook states were saved in the rebuilt one
        (PowerSGD's residuals are flat per bucket; the sparsifier numbers the
        parameters in the order it first sees them). With this step every
        run, fresh or resumed, trains in the rebuilt layout only. It runs
        before the hook is registered (a plain allreduce), leaves the batch
        norm buffers and the gradients as they were, and draws no random numbers.
        """
        module = self.ddp.module
        buffers = {name: b.clone() for name, b in module.named_buffers()}
        images = self.train_set.normalize(self.train_set.images[:2].to(self.device))
        self.ddp(images).float().sum().backward()
        for p in module.parameters():
            p.grad = None
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])

    def _batches(self, epoch: int):
        """This rank's batches of ``epoch``: (uint8 images on the device, labels)."""
        self.sampler.set_epoch(epoch)
        order = torch.tensor(list(self.sampler))
        # Crops and flips from (seed, epoch, rank): a resumed run draws the same ones.
        gen = torch.Generator().manual_seed(((self.args.seed * 100_003 + epoch) * 1009 + self.rank) % (1 << 62))
        for i in range(self.steps_per_epoch):
            with self.timer.phase("time_data_s"):
                idx = order[i * self.args.batch_size:(i + 1) * self.args.batch_size]
                images = self.train_set.images[idx].to(self.device, non_blocking=True)
                if self.augment:
                    images = augment(images, gen)
                images = self.train_set.normalize(images)
                labels = self.train_set.labels[idx].to(self.device, non_blocking=True)
            yield images, labels

    def _run_batch(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        lr = self.args.lr * lr_factor(self.step, self.steps_per_epoch, self.args)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        with self.timer.phase("time_forward_s"):
            with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.args.amp):
                loss = F.cross_entropy(self.ddp(images), labels)
        with self.timer.phase("time_backward_exchange_s"):
            self.scaler.scale(loss).backward()
        with self.timer.phase("time_optimizer_s"):
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.step += 1
        return loss.detach()

    def _run_epoch(self, epoch: int) -> dict:
        self.ddp.train()
        self.timer.reset()
        hook_seconds, sent, dense = self.exchange.hook_seconds, self.exchange.bytes_sent, self.exchange.bytes_dense
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        start = time.perf_counter()
        for i, (images, labels) in enumerate(self._batches(epoch), 1):
            loss = self._run_batch(images, labels)
            loss_sum += loss.double()
            if i % self.args.log_every == 0 or i == self.steps_per_epoch:
                elapsed = time.perf_counter() - start
                logger.info("epoch %d step %d/%d | rank-0 loss %.4f | %.0f img/s | sent %s/step (dense %s)",
                            epoch + 1, i, self.steps_per_epoch, loss.item(),
                            i * self.args.batch_size * self.world_size / elapsed,
                            format_bytes((self.exchange.bytes_sent - sent) / i),
                            format_bytes((self.exchange.bytes_dense - dense) / i))
        seconds = time.perf_counter() - start
        totals = torch.stack([loss_sum, torch.tensor(float(self.steps_per_epoch), device=self.device,
                                                     dtype=torch.float64)])
        dist.all_reduce(totals)
        n = self.steps_per_epoch
        return {
            "train_loss": (totals[0] / totals[1]).item(),
            "images_per_s": n * self.args.batch_size * self.world_size / seconds,
            "time_epoch_s": seconds,
            **{k: self.timer.seconds.get(k, 0.0) for k in ("time_data_s", "time_forward_s",
                                                           "time_backward_exchange_s", "time_optimizer_s")},
            "time_hook_call_s": self.exchange.hook_seconds - hook_seconds,
            "bytes_sent": self.exchange.bytes_sent - sent,
            "bytes_dense": self.exchange.bytes_dense - dense,
            "bytes_sent_per_step": (self.exchange.bytes_sent - sent) / n,
            "bytes_sent_total": self.exchange.bytes_sent,
        }

    @torch.no_grad()
    def _evaluate(self) -> dict:
        """Test loss and accuracy; each rank evaluates its own model on its share, summed over ranks."""
        model = self.ddp.module  # no DDP forward: no buffer broadcast, no collectives per batch
        model.eval()
        idx_all = torch.arange(self.rank, len(self.test_set), self.world_size)
        totals = torch.zeros(3, device=self.device, dtype=torch.float64)
        for chunk in idx_all.split(2 * self.args.batch_size):
            images = self.test_set.normalize(self.test_set.images[chunk].to(self.device))
            labels = self.test_set.labels[chunk].to(self.device)
            with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.args.amp):
                logits = model(images)
            totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum").double()
            totals[1] += (logits.argmax(1) == labels).sum()
            totals[2] += labels.numel()
        dist.all_reduce(totals)
        return {"test_loss": (totals[0] / totals[2]).item(), "test_accuracy": (totals[1] / totals[2]).item()}

    def fit(self) -> List[dict]:
        """Train the remaining epochs; return this run's per-epoch records."""
        a = self.args
        logger.info("%s on %s (%d train / %d test images), %d ranks on %s, hook %s, optimizer %s, "
                    "%d steps/epoch of %d images per rank", a.model, a.data, len(self.train_set),
                    len(self.test_set), self.world_size, self.device, a.hook, a.optimizer,
                    self.steps_per_epoch, a.batch_size)
        records = []
        stop = a.epochs if a.stop_after is None else a.stop_after
        while self.epoch < stop:
            record = {"epoch": self.epoch + 1}
            record.update(self._run_epoch(self.epoch))
            with self.timer.phase("time_eval_s"):
                record.update(self._evaluate())
            record["time_eval_s"] = self.timer.seconds["time_eval_s"]
            record.update(step=self.step, lr=self.optimizer.param_groups[0]["lr"], hook=a.hook,
                          optimizer=a.optimizer, model=a.model, world_size=self.world_size,
                          device=self.device.type, method=a.method, density=a.density,
                          powersgd_rank=a.powersgd_rank, period=a.period)
            self.epoch += 1
            # Metrics first: a kill between the two makes --resume redo this epoch, and the
            # resumed run drops the line (MetricsFile keeps the epochs of the checkpoint).
            if self.metrics is not None:
                self.metrics.write(record)
            if a.out_dir is not None:
                self._save_snapshot()
            records.append(record)
            logger.info("epoch %d: train loss %.4f, test loss %.4f, test accuracy %.2f%%", record["epoch"],
                        record["train_loss"], record["test_loss"], 100 * record["test_accuracy"])
        shown = self.metrics.records if self.metrics is not None else records
        if shown:
            logger.info("summary (%s, hook %s, optimizer %s, %d ranks; bytes are payload per rank):\n%s",
                        a.model, a.hook, a.optimizer, self.world_size, summary_table(shown))
        return records


def _configure_logging(rank: int) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def main(args) -> dict:
    """Train as ``args`` says, in the current process group (or one it makes); return this rank's results."""
    validate_args(args, torch.cuda.is_available())
    device_kind = resolve_device(args, torch.cuda.is_available())
    owns_group = setup_distributed(args, device_kind)
    try:
        _configure_logging(dist.get_rank())
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        elif device_kind == "cpu" and "LOCAL_WORLD_SIZE" in os.environ:
            torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["LOCAL_WORLD_SIZE"])))
        trainer = Trainer(args, _device(device_kind))
        records = trainer.fit()
        params = torch.cat([p.detach().reshape(-1).cpu() for p in trainer.ddp.module.parameters()])
        return {"records": records, "params": params, "hook_stats": getattr(trainer.exchange.state, "stats", dict)()}
    finally:
        if owns_group:
            dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
