"""The controller's progress bar: the postfix shows the latest metrics, formatted sparingly."""

from adaptjax import RunConfig
from adaptjax.controller._progress import ProgressBar


def test_closed_bar_shows_the_last_steps_metrics(capsys, monkeypatch):
    monkeypatch.setattr("adaptjax.controller._progress.is_primary", lambda: True)
    bar = ProgressBar(total=200, initial=0, show=True)
    formatted = []
    original = bar._bar.set_postfix
    monkeypatch.setattr(bar._bar, "set_postfix",
                        lambda **kw: (formatted.append(kw), original(**kw))[-1])
    for t in range(200):
        bar.update({"loss": float(t)}, RunConfig(2, 8))
    bar.close()
    err = capsys.readouterr().err
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert "200/200" in last and "loss=199.0000" in last and "bs=8" in last
    # 200 updates within a few mininterval periods: formatted a handful of times, not 200
    assert 2 <= len(formatted) < 50


def test_hidden_bar_formats_nothing(capsys):
    bar = ProgressBar(total=5, initial=0, show=False)
    for t in range(5):
        bar.update({"loss": float(t)}, RunConfig(2, 8))
    bar.close()
    assert capsys.readouterr().err == ""
