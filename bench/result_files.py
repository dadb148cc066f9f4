"""Results files of the accuracy benchmarks: one JSON line per run, after a first line with the command that made
them; and the loop that trains every run of a plan on one rank, printing each result as a line of such a file.

Example::

    >>> import json, tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
    ...     _ = f.write(json.dumps({"command": "python bench/x.py"}) + "\\n" + json.dumps({"seed": 0}) + "\\n")
    >>> read_results(f.name)
    ({'command': 'python bench/x.py'}, [{'seed': 0}])
"""

import json
from typing import Callable, List, Sequence, Tuple

__all__ = ["read_results", "print_tables", "every_run"]


def read_results(path: str) -> Tuple[dict, List[dict]]:
    """``(header, runs)`` of the results file at ``path``."""
    with open(path) as f:
        first, *rest = [json.loads(line) for line in f if line.strip()]
    return first, rest


def print_tables(paths: Sequence[str], table: Callable[[List[dict]], str]) -> None:
    """Print each results file's command, its header line if it has one, and ``table`` of its runs."""
    for path in paths:
        first, rest = read_results(path)
        header = f"\n{first['header']}" if "header" in first else ""
        print(f"$ {first['command']}{header}\n\n{table(rest)}\n")


def every_run(rank: int, seeds: Sequence[int], runs: Sequence[dict], train: Callable[[dict, int], dict]) -> List[dict]:
    """``train(run, seed)`` for every seed, and every run within it; rank 0 prints each result as a JSON line."""
    results = []
    for seed in seeds:
        for run in runs:
            results.append(train(run, seed))
            if rank == 0:
                print(json.dumps(results[-1]), flush=True)
    return results
