"""examples/gpu_check.py: without a GPU it runs the CPU half, says what it skipped and exits 0;
a mismatch makes it exit non-zero."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_a_gpu_it_runs_the_cpu_half_says_what_it_skipped_and_passes():
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--models", "mlp",
                           "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no GPU found" in done.stdout and "running the CPU half" in done.stdout
    assert "skipped:" in done.stdout and "stages on CUDA devices" in done.stdout
    assert ("mlp / 1f1b on cpu, cpu: outputs, loss and gradients equal the plain model's"
            in done.stdout)
    assert "all 1 checks passed" in done.stdout


def test_a_mismatch_or_a_failure_exits_non_zero(monkeypatch, capsys):
    gpu_check = _module()
    tf32 = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)

    def wrong(name, devices, schedule, size, steps, check, stages):
        check.close(f"{name}: loss", torch.tensor(1.0), torch.tensor(1.1))

    monkeypatch.setattr(gpu_check, "check_model", wrong)
    assert gpu_check.main(["--quick", "--models", "mlp"]) == 1
    assert "MISMATCH" in capsys.readouterr().out

    def broken(*args):
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(gpu_check, "check_model", broken)
    assert gpu_check.main(["--quick", "--models", "mlp"]) == 1
    assert "illegal memory access" in capsys.readouterr().out
    # main() leaves the process's TF32 settings as they were (only the script sets them)
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == tf32


def test_it_checks_every_gpu_and_a_cpu_stage_before_them_and_says_what_a_run_skips():
    gpu_check = _module()
    assert gpu_check.placements(0, quick=False) == {"cpu": ["cpu", "cpu"]}
    assert gpu_check.placements(1, quick=True) == {"gpus": ["cuda:0", "cuda:0"]}
    assert gpu_check.placements(4, quick=False) == {
        "gpus": ["cuda:0", "cuda:1", "cuda:2", "cuda:3"],
        "cpu+gpus": ["cpu", "cuda:0", "cuda:1", "cuda:2"]}
    assert any("no GPU" in s for s in gpu_check.skipped(0, torchrun=True, hf=True))
    assert any("torchrun" in s for s in gpu_check.skipped(2, torchrun=False, hf=True))
    assert gpu_check.skipped(2, torchrun=True, hf=True) == []
    assert any("transformers" in s for s in gpu_check.skipped(2, torchrun=True, hf=False))
