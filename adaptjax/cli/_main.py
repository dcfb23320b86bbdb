"""The ``adaptjax`` command: look at a run directory.

``adaptjax summary RUN_DIR`` prints the events, every decision with its
policy and reason, compile seconds per configuration, the checkpoints and the
last metrics; ``adaptjax plot RUN_DIR`` draws the metrics, the codec and the
events (matplotlib) into ``RUN_DIR/metrics.png``; ``adaptjax report RUN_DIR``
(see ``_report.py``) writes ``report.png`` and ``summary.md``. All read JSONL
only: this module imports nothing but the standard library (and matplotlib
for ``plot``), never jax.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import adaptjax  # lazy: loads no jax
from adaptjax._events import event_latencies
from adaptjax.cli import _plan as _plan  # standard library only (the cost model when planning)
from adaptjax.cli import _report as _report  # standard library only (matplotlib when drawing)
from adaptjax.controller._run_log import read_events, read_jsonl_rows  # standard library only
from adaptjax.launch._launcher import main as launch_main  # standard library only


def _check_run_dir(run_dir: str) -> None:
    if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        raise SystemExit(f"adaptjax: {run_dir} is not a run directory (no metrics.jsonl)")


def _config_label(event: dict) -> str:
    config = event.get("config")
    if isinstance(config, dict) and config:
        return " ".join(f"{k}={v}" for k, v in config.items())
    return "(configuration not recorded)"


def _compile_lines(events: list[dict]) -> list[str]:
    """Compile seconds summed per configuration, in order of first compile."""
    seconds: dict[str, float] = {}
    counts: collections.Counter = collections.Counter()
    for e in events:
        if e.get("kind") == "compile" and isinstance(e.get("latency_s"), int | float):
            label = _config_label(e)
            seconds[label] = seconds.get(label, 0.0) + float(e["latency_s"])
            counts[label] += 1
    background = event_latencies(events, "background_compile")
    if not seconds:
        return []
    lines = [f"compile seconds: {sum(seconds.values()):.2f} in {sum(counts.values())} compile(s)"]
    lines += [f"  {s:7.2f} s  x{counts[k]}  {k}" for k, s in seconds.items()]
    if background:  # announced configurations, compiled while the steps ran
        lines.append(
            f"compiled in the background: {sum(background):.2f} s in {len(background)} "
            "configuration(s) (their first steps above found them compiled)"
        )
    return lines


def summary(run_dir: str) -> str:
    """A short text summary of a controller run directory.

    Args:
      run_dir: the ``run_dir`` given to :class:`adaptjax.Controller`.

    Returns:
      The summary text.

    Example:
      >>> import tempfile, json, os
      >>> from adaptjax.cli._main import summary
      >>> d = tempfile.mkdtemp()
      >>> row = json.dumps({"step": 3, "loss": 0.5})
      >>> _ = open(os.path.join(d, "metrics.jsonl"), "w").write(row)
      >>> print(summary(d).splitlines()[1])
      steps logged: 3
    """
    _check_run_dir(run_dir)
    metrics = read_jsonl_rows(os.path.join(run_dir, "metrics.jsonl"))
    events = read_events(run_dir)
    lines = [
        f"run: {os.path.abspath(run_dir)}",
        f"steps logged: {metrics[-1]['step'] if metrics else 0}",
    ]
    counts = collections.Counter(e["kind"] for e in events)
    if counts:
        lines.append("events: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    for e in events:
        if e["kind"] in ("rescale", "rollback", "resume"):
            detail = {k: v for k, v in e.items() if k not in ("time", "kind")}
            lines.append(f"  {e['kind']}: {detail}")
    lines += _report.decision_lines(events)
    lines += _compile_lines(events)
    ckpt = os.path.join(run_dir, "checkpoints")
    if os.path.isdir(ckpt):
        steps = sorted(int(n) for n in os.listdir(ckpt) if n.isdigit())
        lines.append(f"checkpoints: {steps}")
    last = {}
    for row in metrics:
        last.update(row)
    if last:
        shown = ", ".join(
            f"{k}={v:.4g}" for k, v in sorted(last.items()) if isinstance(v, float) and k != "step"
        )
        lines.append(f"last metrics: {shown}")
    return "\n".join(lines)


def plot(run_dir: str, keys: list[str] | None = None) -> str:
    """Plots metrics over steps into ``run_dir/metrics.png``; returns the path."""
    _check_run_dir(run_dir)
    plt = _report.pyplot("plot")
    metrics = read_jsonl_rows(os.path.join(run_dir, "metrics.jsonl"))
    keys = keys or [
        "loss", "eval_loss", "noise_scale", "batch_size", "learning_rate", "devices",
        "step_time", "eval_accuracy",
    ]
    keys = [k for k in keys if any(k in r for r in metrics)]
    if not keys:
        raise SystemExit(f"adaptjax: no metrics to plot in {run_dir}")
    events = read_events(run_dir)
    fig, axes = plt.subplots(len(keys) + 1, 1, figsize=(8, 2.2 * len(keys) + 1.2), sharex=True)
    axes = list(axes)
    for ax, key in zip(axes, keys, strict=False):
        pts = [(r["step"], r[key]) for r in metrics if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    _report.draw_codec_band(axes[-1], metrics, events)
    _report.draw_events(axes, events, label_ax=axes[0])
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    out = os.path.join(run_dir, "metrics.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``adaptjax`` command.

    Example:
      >>> import contextlib, io
      >>> from adaptjax.cli._main import main
      >>> out = io.StringIO()
      >>> with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
      ...     main(["--help"])
      >>> "``" in out.getvalue(), out.getvalue().startswith("usage: adaptjax")
      (False, True)
    """
    parser = argparse.ArgumentParser(
        prog="adaptjax",
        description="Look at an adaptjax run directory (the run_dir of adaptjax.Controller).",
        epilog="examples:\n  adaptjax summary runs/digits\n  adaptjax plot runs/digits "
        "--keys loss noise_scale\n  adaptjax plan examples/digits.py -- --no-progress",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"adaptjax {adaptjax.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "summary",
        help="print what a run did: events, compile seconds, checkpoints, last metrics",
        description="Print what a run did: events, compile seconds per configuration, "
        "checkpoints and the last metrics.",
    )
    p.add_argument("run_dir", help="the run directory")
    p = sub.add_parser(
        "plot",
        help="plot a run's metrics to RUN_DIR/metrics.png (needs matplotlib)",
        description="Plot a run's metrics over steps to RUN_DIR/metrics.png (needs "
        'matplotlib: pip install "adaptjax[examples]").',
    )
    p.add_argument("run_dir", help="the run directory")
    p.add_argument("--keys", nargs="*", default=None, help="metrics to plot (default: a few)")
    _report.add_parser(sub)
    _plan.add_parser(sub)
    sub.add_parser("launch", help="run a script as N processes (see launch -h)", add_help=False)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:
        return launch_main(argv[1:])
    script_args: list[str] = []
    if argv[:1] == ["plan"] and "--" in argv:  # plan SCRIPT [options] -- SCRIPT_ARGS
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    if args.command == "plan":
        return _plan.run(args, script_args)
    if args.command == "summary":
        print(summary(args.run_dir))
    elif args.command == "report":
        print("\n".join(_report.report(args.run_dir)))
    else:
        print(plot(args.run_dir, args.keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
