"""The hook's work on one bucket with its two result paths, interleaved, over the ``add_`` floor.

Run::

    python bench/compare_result_paths.py            # about 6 s

On the CPU the sparsify hook writes each step's sparse average into a vector
kept at zero between steps (:class:`ddp_hooks.sparsify.memory.SparseOutputs`); on GPUs and with
``gradient_as_bucket_view=True`` it zeroes the bucket and writes there. This
script times both on the same 25 MB bucket at density 0.01, one thread, with
the floor (``residual.add_(grad)``) timed in the same loop: rounds alternate
floor, bucket path, vector path, so the drift of this machine's memory speed
hits all three alike (``bench_sparsify_kernels.py`` times its rows one after
the other, where that drift can exceed the difference). Prints each path's
minimum time over the floor's minimum.
"""

import argparse
import time

import torch

from bench_sparsify_kernels import KernelBucket


def _timed(fn, setup, times):
    setup()
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    p.add_argument("--mb", type=int, default=25, help="bucket size in MB (default 25)")
    p.add_argument("--density", type=float, default=0.01, help="density (default 0.01)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    n = args.mb * 2**20 // 4
    grad, residual = torch.randn(n), torch.zeros(n)
    print(f"{args.mb} MB bucket, density {args.density:g}, 1 thread, min of {args.rounds} interleaved rounds")
    print(f"{'method, scope':<22} {'into the bucket':>16} {'result vector':>14}  (x floor)")
    for method, scope in (("random_block", "bucket"), ("random_block", "layer"), ("randomk", "bucket"),
                          ("randomk", "layer"), ("topk", "bucket")):
        aggregation = "allgather" if method == "topk" else "allreduce"
        paths = {"bucket": KernelBucket(args.mb, args.density, method, scope, aggregation, into_bucket=True),
                 "vector": KernelBucket(args.mb, args.density, method, scope, aggregation)}
        times = {"floor": [], "bucket": [], "vector": []}
        for bucket in paths.values():  # first call: caches and allocations
            bucket.refill()
            bucket.hook_work()
        for _ in range(args.rounds):
            _timed(lambda: residual.add_(grad), lambda: None, times["floor"])
            for path, bucket in paths.items():
                _timed(bucket.hook_work, bucket.refill, times[path])
        floor = min(times["floor"])
        print(f"{method + ', ' + scope:<22} {min(times['bucket']) / floor:>16.2f} {min(times['vector']) / floor:>14.2f}")
        for bucket in paths.values():
            vars(bucket).clear()


if __name__ == "__main__":
    main()
