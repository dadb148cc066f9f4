"""The README's quick start is recipes/quickstart.py, word for word, and it runs under torchrun."""

import os

from paths import ROOT  # noqa: E402
from torchrun import run_under_torchrun  # noqa: E402

SCRIPT = os.path.join(ROOT, "recipes", "quickstart.py")


def test_readme_shows_the_script_word_for_word():
    with open(SCRIPT) as f:
        script = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert f"```python\n{script}```" in readme


def test_script_trains_with_the_hook_under_torchrun(tmp_path):
    proc = run_under_torchrun(SCRIPT, tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("loss "))
    assert float(line.split()[1].rstrip(";")) < 0.3  # chance is ln 2 = 0.69
    assert "'compressed_steps': 300" in line  # the hook ran at every step
    ratio = float(line.split("'compression_ratio': ")[1].split(",")[0])
    assert 1.5 < ratio < 2.5  # the density fell from 1 (dense: 1.0) as its warm-up prescribes
    assert sorted(os.listdir(tmp_path)) == ["quickstart-rank0.pt", "quickstart-rank1.pt"]
