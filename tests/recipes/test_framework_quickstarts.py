"""The README's Lightning, Accelerate and Trainer examples are these recipes word for word, and each trains with
the hook under torchrun and saves its state."""

import importlib.util
import os

import pytest

from paths import ROOT  # noqa: E402
from torchrun import run_under_torchrun  # noqa: E402

#: script, the framework it needs, the file that holds every rank's hook state once it has run
EXAMPLES = [("lightning_quickstart.py", "lightning", "lightning-quickstart.ckpt"),
            ("accelerate_quickstart.py", "accelerate", "accelerate-quickstart/custom_checkpoint_0.pkl"),
            ("trainer_quickstart.py", "transformers", "trainer-quickstart/checkpoint-192/comm_hook_state.pt")]


def _needs(framework):
    return pytest.mark.skipif(importlib.util.find_spec(framework) is None,
                              reason=f"{framework} is not installed: pip install -e '.[{framework}]'")


@pytest.mark.parametrize("script", [script for script, _, _ in EXAMPLES])
def test_readme_shows_the_script_word_for_word(script):
    with open(os.path.join(ROOT, "recipes", script)) as f:
        text = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        assert f"```python\n{text}```" in f.read()


@pytest.mark.parametrize("script, saved", [pytest.param(script, saved, marks=_needs(framework))
                                           for script, framework, saved in EXAMPLES])
def test_script_trains_with_the_hook_under_torchrun(script, saved, tmp_path):
    proc = run_under_torchrun(os.path.join(ROOT, "recipes", script), tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("loss "))
    assert float(line.split()[1].rstrip(";")) < 0.6  # chance is ln 2 = 0.69
    assert "'steps': 192, 'compressed_steps': 192," in line  # 3 epochs of 64 steps: the hook ran at every one
    assert os.path.isfile(tmp_path / saved)
