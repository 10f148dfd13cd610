"""Command line interface: python -m fastdp.accounting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastdp.accounting.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "fastdp.accounting", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def test_epsilon_table():
    res = _run("--sigma", "1.5", "--sample-rate", "0.04", "--steps", "2250", "--delta", "1e-5")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "7.32911" in out  # RDP
    assert "6.77913" in out  # PRV upper bound
    assert "6.60157" in out  # GDP
    assert "APPROXIMATION" in out
    assert "Traceback" not in res.stderr


def test_sigma_table_from_batch_size(capsys):
    assert (
        main(
            [
                "--target-epsilon",
                "3",
                "--batch-size",
                "100",
                "--sample-size",
                "10000",
                "--steps",
                "1000",
                "--delta",
                "1e-5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "0.864" in out and "0.741268" in out and "sigma" in out


def test_default_delta_and_epochs(capsys):
    assert (
        main(
            [
                "--sigma",
                "1.3",
                "--batch-size",
                "256",
                "--sample-size",
                "60000",
                "--epochs",
                "15",
                "--accountants",
                "rdp,gdp",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "steps=3516" in out and "delta=8.33e-06" in out
    assert "prv" not in out.split("note", 1)[1]


@pytest.mark.parametrize(
    "args,match",
    [
        (["--sigma", "-1", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5"], "-1"),
        (["--sigma", "1", "--sample-rate", "2", "--steps", "10", "--delta", "1e-5"], "sample-rate"),
        (["--sigma", "1", "--sample-rate", "0.01", "--steps", "0", "--delta", "1e-5"], "steps"),
        (["--sigma", "1", "--sample-rate", "0.01", "--steps", "10", "--delta", "3"], "delta"),
        (["--sigma", "1", "--sample-rate", "0.01", "--steps", "10"], "delta"),
        (["--sigma", "1", "--sample-rate", "0.01", "--delta", "1e-5"], "steps"),
        (
            [
                "--sigma",
                "1",
                "--sample-rate",
                "0.01",
                "--steps",
                "10",
                "--delta",
                "1e-5",
                "--accountants",
                "x",
            ],
            "'x'",
        ),
        (
            ["--target-epsilon", "0", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5"],
            "target_epsilon",
        ),
        (["--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5"], "--sigma"),
        (["--sigma", "abc"], "invalid float"),
    ],
)
def test_bad_input_exit_2(args, match, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_bad_input_subprocess_no_traceback():
    res = _run("--sigma", "0", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5")
    assert res.returncode == 2
    assert "noise_multiplier" in res.stderr and "Traceback" not in res.stderr


def test_prv_fallback_is_marked(capsys):
    assert main(["--sigma", "0.1", "--sample-rate", "0.01", "--steps", "1000", "--delta", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert "1319.73" in out and "PRV not usable" in out


def test_no_args_prints_help():
    res = _run()
    assert res.returncode == 0
    assert "--target-epsilon" in res.stdout and "examples" in res.stdout
    res = _run("--help")
    assert res.returncode == 0 and "--sample-rate" in res.stdout
