"""The FSDP2 example (recipes/fsdp_replicas.py) under torchrun on 4 ranks: it trains, and a resume through
torch.distributed.checkpoint continues the uninterrupted run bit for bit."""

import os
import re

from fashion_folder import write_fashion_folder
from paths import RECIPES
from torchrun import run_under_torchrun

SCRIPT = os.path.join(RECIPES, "fsdp_replicas.py")


def _final(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"after (\d+) epochs: curve (\[.*\]), sum of the weights (\S+)", proc.stdout)
    assert found, proc.stdout[-2000:]
    return found[-1]


def test_the_example_resumes_bitwise_through_distributed_checkpoint(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_fashion_folder(str(data), n_train=512, n_test=64)
    flags = ["--data-dir", str(data), "--train", "512", "--batch", "16", "--epochs", "2", "--density", "0.05"]
    straight = _final(run_under_torchrun(SCRIPT, tmp_path, 300, nproc=4, args=flags))
    folder = str(tmp_path / "checkpoint")
    first = _final(run_under_torchrun(SCRIPT, tmp_path, 300, nproc=4,
                                      args=flags + ["--checkpoint-dir", folder, "--stop-after", "1"]))
    assert first[0] == "1" and os.path.exists(os.path.join(folder, ".metadata"))
    resumed = _final(run_under_torchrun(SCRIPT, tmp_path, 300, nproc=4,
                                        args=flags + ["--checkpoint-dir", folder, "--resume"]))
    assert resumed == straight and straight[0] == "2"
