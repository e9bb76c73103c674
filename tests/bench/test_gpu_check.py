"""``python -m minillm.gpu_check``: the one command a session lent a GPU runs. Its timings need
the GPU; what can be checked here is its plumbing, its arithmetic and the model it times.
The parts' time budgets are a GPU's: every dry run here passes ``--budgets none``, so that no
test depends on how fast a (busy) CPU runs a part."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from minillm import gpu_check


def test_without_cuda_it_refuses_unless_asked_for_a_dry_run(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("there is a GPU here")
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "--allow-cpu" in capsys.readouterr().err


def test_busy_time_is_the_union_of_kernel_intervals():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(a, b, dev=cuda):
        return SimpleNamespace(device_type=dev, time_range=SimpleNamespace(start=a, end=b))
    # overlapping 0-100 and 50-150, nested 60-70, a gap, 200-300, and a CPU op spanning all
    prof = SimpleNamespace(events=lambda: [ev(50, 150), ev(0, 100), ev(60, 70), ev(200, 300),
                                           ev(0, 1000, cpu)])
    assert gpu_check.busy_ms(prof) == pytest.approx(0.25)     # 250 us


def test_an_unknown_part_is_an_error_naming_it_before_any_part_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--allow-cpu", "--out", str(tmp_path), "--parts", "tests,gpus"])
    assert "unknown part 'gpus'" in capsys.readouterr().err
    assert not (tmp_path / "tests.log").exists()


def test_dry_run_of_the_profile_part_writes_its_table(tmp_path, capsys):
    assert gpu_check.main(["--allow-cpu", "--model", "tiny-llama", "--dtype", "float32",
                           "--attention-backend", "torch", "--parts", "profile",
                           "--budgets", "none", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "profile.json").read_text())
    assert [r["rows"] for r in rows] == list(gpu_check.PROFILE_ROWS)
    assert all(r["step_ms"] > 0 for r in rows)
    assert "| profile | 0 |" in capsys.readouterr().out


@pytest.mark.slow   # reads the real SmolLM2's configuration (make setup converts its GGUF)
def test_smollm2_random_has_the_real_model_s_shapes():
    from minillm.models import ensure_smollm2_cache, load_model
    real = json.loads((ensure_smollm2_cache() / "config.json").read_text())
    model = load_model("smollm2-random", dtype=torch.float32, device="cpu")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(model.config, key) == real[key], key
    assert model.config.rope_parameters["rope_theta"] == real["rope_parameters"]["rope_theta"]


def test_dry_run_of_rung12_and_structured_parts_prints_their_numbers(tmp_path, capsys):
    """Part 5 (what the round's rungs change on a GPU): each part's own printout reaches the
    table, so a lent session reads one table."""
    assert gpu_check.main(["--allow-cpu", "--model", "tiny-llama", "--dtype", "float32",
                           "--parts", "rung12,structured", "--budgets", "none",
                           "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| rung12 | 0 |" in out and "hidden host ms" in (tmp_path / "rung12.log").read_text()
    assert "| structured | 0 |" in out and "mask_ms_median" in out


def test_budgets_are_seconds_per_part_or_none():
    default = gpu_check.parse_budgets(gpu_check.BUDGETS)
    assert list(default) == list(gpu_check.PARTS) and all(b > 0 for b in default.values())
    assert gpu_check.parse_budgets("none") == dict.fromkeys(gpu_check.PARTS)
    mixed = gpu_check.parse_budgets("none,0,1.5,none,2,3,4")
    assert mixed["tests"] is None and mixed["kernels"] is None and mixed["engines"] == 1.5
    for bad, why in [("1,2", "give 7 values"), ("a,1,1,1,1,1,1", "tests's budget 'a'"),
                     ("1,-1,1,1,1,1,1", "kernels's budget '-1'"),
                     ("1,1,inf,1,1,1,1", "engines's budget 'inf'")]:
        with pytest.raises(ValueError, match=why):
            gpu_check.parse_budgets(bad)


@pytest.mark.parametrize("flag, expected", [([], gpu_check.parse_budgets(gpu_check.BUDGETS)),
                                            (["--budgets", "none"], {})])
def test_each_part_runs_under_the_budget_asked_for(tmp_path, monkeypatch, flag, expected):
    """The plumbing without running a part: ``run_part`` records what it is given."""
    given = {}

    def fake_run_part(name, cmd, budget_s, out):
        given[name] = budget_s
        return {"rc": 0, "wall_s": 0.0, "log_tail": ""}
    monkeypatch.setattr(gpu_check, "run_part", fake_run_part)
    assert gpu_check.main(["--allow-cpu", "--out", str(tmp_path), *flag]) == 0
    assert given == {name: expected.get(name) for name in gpu_check.PARTS}


def test_a_bad_budget_is_an_error_naming_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--allow-cpu", "--out", str(tmp_path), "--budgets", "1,2"])
    assert "--budgets='1,2'" in capsys.readouterr().err


def test_a_part_without_a_budget_runs_to_its_end_and_one_past_it_is_stopped(tmp_path):
    """A part that never ends is stopped at its budget, however busy the machine; one without a
    budget is never stopped (this one ends by itself)."""
    import sys
    done = gpu_check.run_part("fast", [sys.executable, "-c", "print('ok')"], None, tmp_path)
    assert done["rc"] == 0 and "ok" in (tmp_path / "fast.log").read_text()
    never = [sys.executable, "-c", "import threading; threading.Event().wait()"]
    assert gpu_check.run_part("hung", never, 0.5, tmp_path)["rc"] == "timeout"
