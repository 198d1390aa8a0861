"""`python scripts/gpu_check.py` on the CPU: every check a CPU can run passes against its
reference (FlexAttention forward only, float8 emulated), the training step reports tokens/s and
MFU, a broken kernel makes its check fail and the command exit 1, and a bad option is one line.
Compiled blocks are left to tests/train/test_compile.py (CPU inductor takes minutes here)."""

import pytest
import torch

import pipekit.tools.device_checks as device_checks
from pipekit.tools.gpu_check import main

CPU_CHECKS = "flex_attention,grouped_experts,mpipemoe,activation_offload,low_precision_linear"


def test_the_checks_a_cpu_can_run_pass_and_the_training_step_is_timed(capsys):
    code = main(["--device", "cpu", "--only", f"{CPU_CHECKS},training", "--steps", "2",
                 "--seq-len", "32"])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = printed.strip().splitlines()[-1]
    assert result.startswith("RESULT device=CPU passed=5 failed=0 ")
    assert "tokens_per_s=" in result and "mfu=" in result and "FAILED" not in printed


def test_a_wrong_kernel_fails_its_check_and_the_command(capsys, monkeypatch):
    """Ablation: grouped matmuls that drop the last expert's rows."""
    real = device_checks.grouped_matmul

    def drops_last_expert(x, w, counts, out=None):
        result = real(x, w, counts, out)
        result[-counts[-1] :] = 0
        return result

    monkeypatch.setattr(device_checks, "grouped_matmul", drops_last_expert)
    assert main(["--device", "cpu", "--only", "grouped_experts"]) == 1
    printed = capsys.readouterr().out
    assert "FAILED" in printed and "failed=1" in printed.splitlines()[-1]
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cpu", "--only", "grouped_expert"])
    assert exit_info.value.code == 2
    assert "unknown checks ['grouped_expert']" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            main([])
        assert "no CUDA device here" in capsys.readouterr().err
