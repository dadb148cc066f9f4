"""The AdamW benchmarks' own parts: the candidates' hand-written AdamW step is torch's, the language model is
causal, its schedule warms up and decays, and the results files read back."""

import doctest
import json
import math
import os
import sys

import torch

from paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "recipes"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_adam_candidates  # noqa: E402
import bench_fortunes_transformer  # noqa: E402
import result_files  # noqa: E402


def test_the_candidates_adamw_step_is_torchs_when_fed_the_gradient_and_its_square():
    torch.manual_seed(0)
    p = torch.randn(50)
    reference = torch.nn.Parameter(p.clone())
    adamw = torch.optim.AdamW([reference], lr=1e-3, weight_decay=0.01, foreach=False)
    m, v = torch.zeros(50), torch.zeros(50)
    for step in range(1, 6):
        g = torch.randn(50)
        reference.grad = g.clone()
        adamw.step()
        bench_adam_candidates.adamw_step(p, m, v, g, g * g, step, 1e-3, 0.01)
        torch.testing.assert_close(p, reference.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, adamw.state[reference]["exp_avg"])
    torch.testing.assert_close(v, adamw.state[reference]["exp_avg_sq"])


def test_block_positions_are_whole_blocks_inside_the_tensor():
    positions = bench_adam_candidates.block_positions(10, 0.5, 4, torch.Generator().manual_seed(0))
    assert len(positions) <= 8 and positions.max() < 10 and len(set(positions.tolist())) == len(positions)
    starts = {int(p) // 4 for p in positions}
    assert len(starts) == 2  # ceil(0.5 * 10 / 4) = 2 blocks of the 3 (the last holds entries 8 and 9)


def test_the_language_model_sees_no_later_character():
    torch.manual_seed(0)
    model = bench_fortunes_transformer.CharTransformer(vocab=20, width=32, layers=2, context=16)
    ids = torch.randint(0, 20, (1, 16))
    changed = ids.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 20
    with torch.no_grad():
        before, after = model(ids), model(changed)
    torch.testing.assert_close(before[0, :10], after[0, :10])
    assert not torch.allclose(before[0, 10:], after[0, 10:])


def test_the_schedule_warms_up_over_a_twentieth_then_decays_to_zero():
    lr = bench_fortunes_transformer.learning_rate
    assert lr(1.0, 0, 200) == 0.1 and lr(1.0, 9, 200) == 1.0
    assert math.isclose(lr(1.0, 10, 200), 1.0) and lr(1.0, 199, 200) < 1e-3
    assert all(lr(1.0, s, 200) >= lr(1.0, s + 1, 200) for s in range(10, 199))


def test_results_files_read_back_and_print_their_tables(tmp_path, capsys):
    path = tmp_path / "runs.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in ({"command": "c", "header": "h"}, {"seed": 0, "v": 1})) + "\n")
    assert result_files.read_results(str(path)) == ({"command": "c", "header": "h"}, [{"seed": 0, "v": 1}])
    result_files.print_tables([str(path)], lambda runs: f"{len(runs)} runs")
    assert capsys.readouterr().out == "$ c\nh\n\n1 runs\n\n"
    train = lambda run, seed: {"name": run["n"], "seed": seed}  # noqa: E731
    assert result_files.every_run(1, [0, 1], [{"n": "a"}], train) == [{"name": "a", "seed": 0}, {"name": "a", "seed": 1}]
    assert capsys.readouterr().out == ""  # only rank 0 prints
    result_files.every_run(0, [0, 1], [{"n": "a"}, {"n": "b"}], train)
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == [{"name": n, "seed": s} for s in (0, 1) for n in ("a", "b")]  # seed by seed, a line each
    assert doctest.testmod(result_files).failed == 0


def test_snr_blocks_favour_the_blocks_where_adams_step_is_steady():
    m = torch.zeros(40)
    m[:4] = 1.0  # one block of steady gradient; v equal everywhere
    state = {"exp_avg": m, "exp_avg_sq": torch.ones(40)}
    draws = torch.Generator().manual_seed(0)
    picks = [bench_adam_candidates.snr_block_positions(40, 0.1, 4, draws, state) for _ in range(200)]
    assert all(len(p) == 4 and len(set(p.tolist())) == 4 for p in picks)  # one whole block of 4 each time
    first = sum(int(p[0]) == 0 for p in picks) / len(picks)
    assert first > 0.4  # weight 1.1 (0.1 of it the floor) against 0.1 for each of the 9 others: 0.55 of the draws
