"""``python -m fastdp.accounting --plot``: the curves (against get_epsilon / get_noise_multiplier), the drawing
through a fake matplotlib (the real one is optional and not installed in the dev venv), and the clear error
without matplotlib."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from fastdp.accounting import get_epsilon, get_noise_multiplier
from fastdp.accounting.cli import main
from fastdp.accounting.plot import MATPLOTLIB_MISSING, plot_data, write_plot

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def test_plot_data_matches_the_accountants():
    d = plot_data(sigma=1.0, sample_rate=0.02, steps=200, delta=1e-5, accountants=["rdp", "gdp"], points=6)
    assert d["step_grid"][0] == 1 and d["step_grid"][-1] == 200 and len(d["step_grid"]) == 6
    for name in ("rdp", "gdp"):
        for t, e in zip(d["step_grid"], d["epsilon"][name], strict=True):
            assert e == pytest.approx(get_epsilon(1.0, 0.02, t, 1e-5, accountant=name), rel=1e-12)
    eps = d["epsilon"]["rdp"]
    assert all(a < b for a, b in zip(eps, eps[1:], strict=False))  # epsilon grows with steps
    final = eps[-1]
    assert d["targets"][0] == pytest.approx(final / 4) and d["targets"][-1] == pytest.approx(final * 4)
    sig = d["sigma_for_target"]["rdp"]
    assert sig == [pytest.approx(get_noise_multiplier(e, 1e-5, 0.02, steps=200, accountant="rdp"), rel=1e-12)
                   for e in d["targets"]]
    assert all(a > b for a, b in zip(sig, sig[1:], strict=False))  # more epsilon, less noise
    for e, s in zip(d["targets"], sig, strict=True):  # each calibrated sigma meets its target
        assert get_epsilon(s, 0.02, 200, 1e-5, accountant="rdp") <= e * (1 + 1e-9)


def test_plot_data_few_steps_and_bad_points():
    d = plot_data(sigma=2.0, sample_rate=0.5, steps=3, delta=1e-5, accountants=["rdp"], points=12)
    assert d["step_grid"] == [1, 2, 3]
    with pytest.raises(ValueError, match="plot-points"):
        plot_data(sigma=2.0, sample_rate=0.5, steps=3, delta=1e-5, accountants=["rdp"], points=1)


class _Recorder:
    """Stands in for matplotlib's figure and axes: records every call."""

    def __init__(self, log, name):
        self._log, self._name = log, name

    def __getattr__(self, attr):
        def call(*args, **kwargs):
            self._log.append((self._name, attr, args, kwargs))
            if attr == "savefig":
                with open(args[0], "wb") as f:
                    f.write(b"FAKEPNG")

        return call


@pytest.fixture
def fake_matplotlib(monkeypatch):
    log: list = []
    mpl = types.ModuleType("matplotlib")
    mpl.use = lambda backend: log.append(("matplotlib", "use", (backend,), {}))
    plt = types.ModuleType("matplotlib.pyplot")
    axes = (_Recorder(log, "ax1"), _Recorder(log, "ax2"))
    plt.subplots = lambda *a, **k: (_Recorder(log, "fig"), axes)
    plt.close = lambda fig: log.append(("plt", "close", (), {}))
    mpl.pyplot = plt
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", plt)
    return log


def test_cli_plot_with_fake_matplotlib(fake_matplotlib, tmp_path, capsys):
    out = tmp_path / "eps.png"
    rc = main(["--sigma", "1.0", "-q", "0.02", "--steps", "200", "--delta", "1e-5", "--accountants", "rdp",
               "--plot", str(out), "--plot-points", "5"])
    assert rc == 0
    assert out.read_bytes() == b"FAKEPNG"
    assert f"plot written to {out}" in capsys.readouterr().out
    log = fake_matplotlib
    assert ("matplotlib", "use", ("Agg",), {}) in log
    want = plot_data(sigma=1.0, sample_rate=0.02, steps=200, delta=1e-5, accountants=["rdp"], points=5)
    plots = {name: (args, kw) for name, attr, args, kw in log if attr == "plot"}
    assert list(plots["ax1"][0][0]) == want["step_grid"] and list(plots["ax1"][0][1]) == want["epsilon"]["rdp"]
    assert list(plots["ax2"][0][0]) == want["targets"] and list(plots["ax2"][0][1]) == want["sigma_for_target"]["rdp"]
    assert "RDP" in plots["ax1"][1]["label"]
    assert any(attr == "close" for _, attr, _, _ in log)


def test_cli_plot_target_epsilon_uses_calibrated_sigma(fake_matplotlib, tmp_path):
    out = tmp_path / "eps.png"
    assert main(["--target-epsilon", "2", "-q", "0.02", "--steps", "100", "--delta", "1e-5", "--accountants",
                 "rdp", "--plot", str(out), "--plot-points", "3"]) == 0
    sigma = get_noise_multiplier(2.0, 1e-5, 0.02, steps=100, accountant="rdp")
    ax1 = [args for name, attr, args, _ in fake_matplotlib if name == "ax1" and attr == "plot"][0]
    assert ax1[1][-1] == pytest.approx(get_epsilon(sigma, 0.02, 100, 1e-5, accountant="rdp"), rel=1e-12)
    assert ax1[1][-1] <= 2.0


def test_gdp_is_labelled_an_approximation(fake_matplotlib, tmp_path):
    data = plot_data(sigma=1.0, sample_rate=0.1, steps=10, delta=1e-5, accountants=["gdp"], points=2)
    write_plot(data, str(tmp_path / "g.png"))
    labels = [kw["label"] for name, attr, _, kw in fake_matplotlib if attr == "plot"]
    assert labels and all("APPROXIMATION" in lab for lab in labels)


def test_cli_plot_without_matplotlib_is_a_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    with pytest.raises(SystemExit) as exc:
        main(["--sigma", "1.0", "-q", "0.02", "--steps", "10", "--delta", "1e-5", "--plot", str(tmp_path / "x.png")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install matplotlib" in err
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        write_plot({}, str(tmp_path / "y.png"))
    assert "pip install matplotlib" in MATPLOTLIB_MISSING


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed (optional; needed only for --plot)")
def test_cli_plot_real_matplotlib_writes_a_png(tmp_path):
    out = tmp_path / "eps.png"
    assert main(["--sigma", "1.0", "-q", "0.02", "--steps", "50", "--delta", "1e-5", "--accountants", "rdp",
                 "--plot", str(out), "--plot-points", "3"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
