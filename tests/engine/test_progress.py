"""``fastdp.progress(loader, engine)``: yields the loader's items unchanged and shows the released steps and the
live epsilon (tqdm when installed, log lines otherwise)."""

from __future__ import annotations

import importlib.util
import io
import logging

import pytest
import torch
from torch import nn

import fastdp
from fastdp.progress_bar import epsilon_postfix
from tests.oracle import make_engine


def _engine():
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    eng = make_engine(model, batch_size=4, sigma=1.0, sample_size=40)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng.attach(opt)
    return model, eng, opt


def _train(model, opt, items):
    for x in items:
        model(x).pow(2).sum(1).mean().backward()
        opt.step()
        opt.zero_grad()


def test_progress_bar_shows_final_step_and_epsilon():
    pytest.importorskip("tqdm")
    model, eng, opt = _engine()
    data = [torch.randn(4, 3, dtype=torch.float64) for _ in range(6)]
    buf = io.StringIO()
    seen = []
    for x in fastdp.progress(data, eng, file=buf, mininterval=0):
        seen.append(x)
        _train(model, opt, [x])
    assert len(seen) == 6 and all(a is b for a, b in zip(seen, data, strict=True))
    out = buf.getvalue()
    assert "6/6" in out and "step=6" in out
    assert f"eps={eng.live_epsilon():.3g}" in out
    assert epsilon_postfix(eng) == {"step": "6", "eps": f"{eng.live_epsilon():.3g}"}


def test_progress_disabled_prints_nothing_and_refuses_non_engine():
    pytest.importorskip("tqdm")
    model, eng, opt = _engine()
    buf = io.StringIO()
    assert len(list(fastdp.progress(range(3), eng, file=buf, disable=True))) == 3
    assert buf.getvalue() == ""
    with pytest.raises(ValueError, match="not a fastdp.PrivacyEngine"):
        list(fastdp.progress(range(3), object()))


def test_progress_without_tqdm_logs(monkeypatch, caplog):
    model, eng, opt = _engine()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tqdm" else real(name, *a))
    data = [torch.randn(4, 3, dtype=torch.float64) for _ in range(20)]
    with caplog.at_level(logging.INFO, logger="fastdp.progress_bar"):
        for x in fastdp.progress(data, eng, desc="run"):
            _train(model, opt, [x])
    msgs = [r.getMessage() for r in caplog.records if r.name == "fastdp.progress_bar"]
    assert msgs[-1] == f"run: done (20 items), step 20, epsilon {eng.live_epsilon():.3g}"
    assert any(m.startswith("run: 2/20, step 2,") for m in msgs)
