"""``adaptjax report RUN_DIR``: a picture and a written account of what a run did and why.

``report.png`` shows, over steps: train and validation loss; the batch size
beside the measured gradient noise scale (the quantity ``AdaptiveBatchSize``
compares it with); the learning rate; the devices, codec and sync strategy as
coloured bands; the bytes each device sends per step; the step time with
compilations marked; and every event (decision, rescale, rollback, resume,
stop, ...) as a labelled vertical marker; critical-batch probes are points
beside the noise scale. ``summary.md`` lists every decision with the policy
that made it, its reason and the metrics it saw, the compiles' share of the
run, and every probe's critical batch beside the noise scale of its step.

Reads JSONL only: this module imports the standard library (and matplotlib for
the picture), never jax.
"""

from __future__ import annotations

import math
import os
import re

from adaptjax._events import event_latencies
from adaptjax.controller._run_log import read_events, read_jsonl_rows  # standard library only

# Events drawn as vertical markers, with their colour; the label says what happened.
_MARKED = {
    "decision": "tab:purple",
    "rescale": "tab:red",
    "rollback": "black",
    "resume": "tab:green",
    "stop": "tab:brown",
    "preempted": "tab:brown",
    "nonfinite_stop": "black",
    "relaunch": "tab:red",
    "checkpoint_skipped": "tab:gray",
}

# Metrics a decision's "seen" column shows first (others follow in name order, up to a few):
# what the built-in policies decide on, the compile cost AdaptiveBatchSize weighs included.
_KEY_METRICS = (
    "loss", "eval_loss", "noise_scale", "critical_batch", "batch_size", "devices",
    "learning_rate", "step_time", "compile_seconds", "train_seconds", "comm_share", "grad_snr",
)
_SEEN = 10  # metrics a decision row shows


def load_run(run_dir: str) -> tuple[list[dict], list[dict]]:
    """``(metrics rows, events)`` of a run directory; a one-line SystemExit if it is not one."""
    if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        raise SystemExit(f"adaptjax: {run_dir} is not a run directory (no metrics.jsonl)")
    return (
        read_jsonl_rows(os.path.join(run_dir, "metrics.jsonl")),
        read_events(run_dir),
    )


def _short_codec(key) -> str:
    """``"_OneBit(axis_name='data', ...)"`` -> ``"onebit"``; ``None`` -> ``"dense"``."""
    if key in (None, "", "None"):
        return "dense"
    name = str(key).split("(")[0].split(":")[-1].split(".")[-1].lstrip("_")
    return name.lower() or str(key)


def _short_action(text: str) -> str:
    """A few words for a logged action ``repr``, for the picture's markers."""
    m = re.match(r"(\w+)\((.*)\)$", text.strip(), re.S)
    if not m:
        return text[:24]
    kind, body = m.groups()
    if kind == "SetBatchSize":
        return "batch " + body.split(",")[0].split("=")[-1]
    if kind == "Rescale":
        dev = re.search(r"devices=(\w+)", body)
        return f"{dev.group(1) if dev else '?'} devices"
    if kind == "SetCodec":
        return "codec " + _short_codec(body.split("=", 1)[-1])
    if kind == "SetHyperparams":
        keys = re.findall(r"'(\w+)':", body)
        return "set " + ",".join("lr" if k == "learning_rate" else k for k in keys)
    return kind.lower()


def split_reason(reason: str) -> tuple[str, str]:
    """``"Policy: why"`` -> ``("Policy", "why")``; without a policy name -> ``("", reason)``.

    Example:
      >>> split_reason("ElasticScale: schedule entry {40: 4} is due")
      ('ElasticScale', 'schedule entry {40: 4} is due')
      >>> split_reason("loss reached 0.1")
      ('', 'loss reached 0.1')
    """
    m = re.match(r"([A-Za-z_][\w.()]*): (.*)$", reason or "", re.S)
    return (m.group(1), m.group(2)) if m else ("", reason or "")


def decisions(events: list[dict]) -> list[dict]:
    """One row per action a policy decided: step, metrics step, action, policy, reason, metrics.

    Decisions logged before actions carried reasons have an empty reason.
    """
    rows = []
    for e in events:
        if e.get("kind") != "decision":
            continue
        actions = e.get("actions") or []
        reasons = e.get("reasons") or [""] * len(actions)
        for action, reason in zip(actions, reasons, strict=False):
            policy, why = split_reason(reason)
            if not policy:  # Stop/Rollback carry their reason inside the repr
                m = re.search(r"reason='(.*)'\)$", action)
                why = why or (m.group(1) if m else "")
            rows.append({
                "step": e.get("step"),
                "metrics_step": e.get("metrics_step", e.get("step")),
                "action": action,
                "policy": policy,
                "reason": why,
                "metrics": e.get("metrics") or {},
            })
    return rows


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _seen(metrics: dict, limit: int = 8) -> str:
    keys = [k for k in _KEY_METRICS if k in metrics]
    keys += sorted(k for k in metrics if k not in keys)[: max(limit - len(keys), 0)]
    return ", ".join(f"{k}={_fmt(metrics[k])}" for k in keys[:limit])


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
    pts = [(s, v) for s, v in pts if math.isfinite(v)]
    return [p[0] for p in pts], [p[1] for p in pts]


def noise_scale_series(rows: list[dict]) -> tuple[list[int], list[float]]:
    """The logged noise scale per step, NaN where no valid reading exists.

    A reading is invalid before the monitor's averages hold a sample and while
    the smoothed ``|G|^2`` is not positive (``noise_scale_valid`` is 0); the
    NaN breaks the plotted line there instead of drawing across the gap. A
    valid 0 (the variance estimate clipped at 0) has no place on the plot's
    log axis and is a gap too.

    Example:
      >>> noise_scale_series([{"step": 1, "noise_scale": 0.0, "noise_scale_valid": 0.0},
      ...                     {"step": 2, "noise_scale": 40.0, "noise_scale_valid": 1.0}])
      ([1, 2], [nan, 40.0])
    """
    steps, values = [], []
    for r in rows:
        v = r.get("noise_scale")
        if not isinstance(v, int | float):
            continue
        ok = r.get("noise_scale_valid", 1.0) > 0 and math.isfinite(v) and v > 0
        steps.append(r["step"])
        values.append(float(v) if ok else math.nan)
    return steps, values


def _sync_label(key) -> str:
    """A band's label for a sync strategy's key (``None``: the S-SGD all-reduce)."""
    return "all-reduce (S-SGD)" if key is None else str(key)


def _bands(metrics: list[dict], events: list[dict]) -> dict[str, list[tuple[int, int, str]]]:
    """Spans ``(start, stop, label)`` of devices, codec and sync strategy over the run."""
    last = metrics[-1]["step"] if metrics else 0
    configs = sorted(
        (e["step"], e["config"]) for e in events
        if e.get("kind") in ("compile", "precompile_used") and isinstance(e.get("config"), dict)
    )
    def spans(points):
        out = []
        for step, label in points:
            if out and out[-1][2] == label:
                continue
            if out:
                out[-1] = (out[-1][0], step, out[-1][2])
            out.append((step, last, label))
        return out

    devices = []
    for r in metrics:
        if isinstance(r.get("devices"), int | float):
            devices.append((r["step"], f"{int(r['devices'])} dev"))
    codec_points = [(0, "dense")]
    sync_points = []
    for step, config in configs:
        if "codec" in config:
            codec_points.append((step, _short_codec(config["codec"])))
        for key in ("sync", "sync_strategy", "strategy"):
            if key in config:
                sync_points.append((step, _sync_label(config[key])))
    for e in events:
        if e.get("kind") == "set_codec":
            codec_points.append((e["step"], _short_codec(e.get("codec"))))
        if e.get("kind") in ("set_sync", "switch_sync"):
            sync_points.append((e["step"], _sync_label(e.get("sync", e.get("strategy", "?")))))
    codec_points.sort(key=lambda p: p[0])
    sync_points.sort(key=lambda p: p[0])
    return {
        "devices": spans(devices),
        "codec": spans(codec_points),
        "sync": spans(sync_points or [(0, _sync_label(None))]),
    }


def draw_codec_band(ax, metrics: list[dict], events: list[dict]) -> None:
    """Devices, codec and sync strategy over the run as three rows of labelled bands on ``ax``."""
    bands = _bands(metrics, events)
    palette = ["#cfe2f3", "#f4cccc", "#d9ead3", "#fff2cc", "#ead1dc", "#d0e0e3", "#fce5cd"]
    colour_of: dict[str, str] = {}
    for row, name in enumerate(("devices", "codec", "sync")):
        for start, stop, label in bands[name]:
            colour = colour_of.setdefault(label, palette[len(colour_of) % len(palette)])
            ax.broken_barh([(start, max(stop - start, 0.5))], (row - 0.4, 0.8),
                           facecolors=colour, edgecolors="gray", lw=0.5)
            ax.text(start + 0.5, row, label, va="center", ha="left", fontsize=7, clip_on=True)
    ax.set_yticks([0, 1, 2], ["devices", "codec", "sync"])
    ax.set_ylim(-0.6, 2.6)
    ax.invert_yaxis()


def decision_lines(events: list[dict]) -> list[str]:
    """Text lines for ``adaptjax summary``: each decision's step, action, policy and reason."""
    rows = decisions(events)
    if not rows:
        return []
    out = [f"decisions: {len(rows)} action(s)"]
    for r in rows:
        who = r["policy"] or "(policy not named)"
        why = r["reason"] or "(no reason recorded)"
        out.append(f"  step {r['step']}: {r['action']}  by {who}: {why}")
    return out


def add_parser(sub) -> None:
    """Registers ``adaptjax report RUN_DIR`` on the CLI's subparsers."""
    p = sub.add_parser(
        "report",
        help="write RUN_DIR/report.png and RUN_DIR/summary.md (needs matplotlib)",
        description="Draw what a run did (losses, batch size and noise scale, learning rate, "
        "devices/codec/sync bands, bytes per step, step time, events) into RUN_DIR/report.png "
        "and list every decision with its policy, reason and metrics in RUN_DIR/summary.md.",
    )
    p.add_argument("run_dir", help="the run directory")


def _marker_events(events: list[dict]) -> list[tuple[int, str, str]]:
    """``(step, label, colour)`` of the events drawn as vertical markers."""
    out = []
    for e in events:
        kind = e.get("kind")
        if kind not in _MARKED:
            continue
        step = e.get("step", 0)
        if kind == "decision":
            label = "; ".join(_short_action(a) for a in e.get("actions", []))
        elif kind == "rescale":
            label = f"rescale {e.get('devices_from')}->{e.get('devices_to')}"
        else:
            label = kind
        out.append((step, label, _MARKED[kind]))
    return out


def draw_events(axes, events: list[dict], label_ax=None) -> None:
    """Draws every marked event as a vertical line on ``axes`` (labels on ``label_ax``)."""
    marks = _marker_events(events)
    for ax in axes:
        for step, _, colour in marks:
            ax.axvline(step, color=colour, lw=0.8, alpha=0.55, ls="--")
    if label_ax is not None:
        ymax = label_ax.get_ylim()[1]
        lo, hi = label_ax.get_xlim()
        near = 0.06 * (hi - lo)  # labels closer than this stack downwards
        placed: list[tuple[float, int]] = []
        for step, label, colour in marks:
            busy = {level for x, level in placed if abs(x - step) < near}
            level = min(set(range(len(busy) + 1)) - busy)
            placed.append((step, level))
            label_ax.annotate(
                label, (step, ymax), xytext=(2, -4 - 8 * (level % 8)), textcoords="offset points",
                fontsize=6.5, color=colour, rotation=0, va="top", ha="left", clip_on=True,
            )


def _title(run_dir: str, metrics: list[dict], events: list[dict]) -> str:
    steps = metrics[-1]["step"] if metrics else 0
    _, batch = _series(metrics, "batch_size")
    _, devices = _series(metrics, "devices")
    codecs = sorted({_short_codec(e.get("codec")) for e in events if e.get("kind") == "set_codec"})
    parts = [f"{os.path.basename(os.path.abspath(run_dir))}: {steps} steps"]
    if batch:
        parts.append(f"batch {int(min(batch))}-{int(max(batch))}")
    if devices:
        parts.append(f"devices {int(min(devices))}-{int(max(devices))}")
    if codecs:
        parts.append("codec " + "/".join(["dense", *codecs]))
    evals = [r["eval_loss"] for r in metrics if isinstance(r.get("eval_loss"), int | float)]
    if evals:
        parts.append(f"final val loss {evals[-1]:.3f}")
    n = sum(1 for e in events if e.get("kind") == "decision")
    parts.append(f"{n} decisions")
    return "adaptjax run " + ", ".join(parts)


def pyplot(command: str):
    """``matplotlib.pyplot`` on the Agg backend, or a one-line exit naming the extra."""
    try:
        import matplotlib  # an optional dependency (the "examples" extra)
    except ImportError:
        raise SystemExit(
            f'adaptjax {command} needs matplotlib: pip install "adaptjax[examples]" '
            "(or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def render(run_dir: str, out: str | None = None) -> str:
    """Draws ``report.png`` (or ``out``) for ``run_dir``; returns its path."""
    plt = pyplot("report")
    metrics, events = load_run(run_dir)
    fig, axes = plt.subplots(
        6, 1, figsize=(11, 13), sharex=True,
        gridspec_kw={"height_ratios": [2.2, 1.6, 1.1, 1.2, 1.1, 1.3]},
    )
    ax_loss, ax_batch, ax_lr, ax_band, ax_bytes, ax_time = axes
    _draw_loss(ax_loss, metrics)
    _draw_batch(ax_batch, metrics, events, plt)
    _draw_learning_rate(ax_lr, metrics)
    draw_codec_band(ax_band, metrics, events)
    _draw_wire(ax_bytes, metrics)
    _draw_step_time(ax_time, metrics, events)
    for ax in axes:
        ax.grid(alpha=0.25)
    draw_events(axes, events, label_ax=ax_loss)
    fig.suptitle(_title(run_dir, metrics, events), fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    out = out or os.path.join(run_dir, "report.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _draw_loss(ax, metrics: list[dict]) -> None:
    """Train loss (and its running mean), validation loss, one more eval metric on a twin."""
    s, v = _series(metrics, "loss")
    ax.plot(s, v, lw=0.7, color="tab:blue", alpha=0.6, label="train loss")
    if len(v) > 10:
        k = max(len(v) // 30, 2)
        smooth = [sum(v[max(0, i - k):i + 1]) / len(v[max(0, i - k):i + 1]) for i in range(len(v))]
        ax.plot(s, smooth, lw=1.5, color="tab:blue", label=f"train loss ({k + 1}-step mean)")
    s, v = _series(metrics, "eval_loss")
    if s:
        ax.plot(s, v, "o-", color="tab:orange", ms=4, label="validation loss")
    for key in sorted({k for r in metrics for k in r if k.startswith("eval_")} - {"eval_loss"}):
        if key in ("eval_bpb",):
            continue
        s, v = _series(metrics, key)
        if s:
            twin = ax.twinx()
            twin.plot(s, v, "s-", color="tab:green", ms=3, label=key)
            twin.set_ylabel(key)
            break
    ax.set_ylabel("loss")
    ax.legend(loc="center right", fontsize=7)


def _draw_batch(ax, metrics: list[dict], events: list[dict], plt) -> None:
    """The batch size against the measured noise scale (and probes), on a log2 axis."""
    from matplotlib.ticker import LogLocator, ScalarFormatter  # optional, as in pyplot()

    s, v = _series(metrics, "batch_size")
    ax.step(s, v, where="post", color="tab:red", lw=1.5, label="batch size")
    s, v = noise_scale_series(metrics)
    if any(math.isfinite(x) for x in v):
        ax.plot(s, v, lw=0.8, color="tab:gray", alpha=0.9,
                label="measured noise scale (AdaptiveBatchSize's input; gaps: "
                      "invalid or zero)")
    probes = [(e["step"], e["critical_batch"]) for e in events if e.get("kind") == "probe"
              and isinstance(e.get("critical_batch"), int | float)
              and math.isfinite(e["critical_batch"]) and e["critical_batch"] > 0]
    if probes:
        ax.plot(*zip(*probes, strict=True), "D", color="tab:green", ms=5,
                label="critical batch (probe)")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=2))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_ylabel("samples (log)")
    ax.legend(loc="best", fontsize=7)


def _draw_learning_rate(ax, metrics: list[dict]) -> None:
    s, v = _series(metrics, "learning_rate")
    if s:
        ax.step(s, v, where="post", color="tab:purple", lw=1.3)
    else:
        ax.text(0.5, 0.5, "learning rate not logged", transform=ax.transAxes,
                ha="center", fontsize=8)
    ax.set_ylabel("learning rate")


def _draw_wire(ax, metrics: list[dict]) -> None:
    """Measured bytes per device and step, else the modelled communication time."""
    s, v = _series(metrics, "wire_bytes")
    if s:
        ax.step(s, [x / 1e6 for x in v], where="post", color="tab:cyan", lw=1.3)
        ax.set_ylabel("MB sent /\ndevice / step")
    else:
        s, v = _series(metrics, "comm_time")
        ax.step(s, v, where="post", color="tab:cyan", lw=1.3)
        ax.set_ylabel("modelled comm s")
        if not s:
            ax.text(0.5, 0.5, "no link modelled (link_bandwidth=None)",
                    transform=ax.transAxes, ha="center", fontsize=8)
    ax.set_ylim(bottom=0)


def _draw_step_time(ax, metrics: list[dict], events: list[dict]) -> None:
    """Step time, with each compile marked above it and labelled with its seconds."""
    s, v = _series(metrics, "step_time")
    ax.plot(s, v, lw=1.0, color="tab:olive", label="step time (median of last 32)")
    compiles = [(e["step"], e.get("latency_s", 0.0)) for e in events if e.get("kind") == "compile"]
    if compiles:
        top = max(v) if v else 1.0
        ax.plot([c[0] for c in compiles], [top * 1.05] * len(compiles), "v", color="black",
                ms=5, label="compile (seconds)")
        for step, sec in compiles:
            ax.annotate(f"{sec:.1f}s", (step, top * 1.05), xytext=(2, 3),
                        textcoords="offset points", fontsize=6)
        ax.set_ylim(0, top * 1.25)
    ax.set_ylabel("seconds")
    ax.set_xlabel("step")
    ax.legend(loc="upper right", fontsize=7)


def summary_markdown(run_dir: str) -> str:
    """The text of ``summary.md``: what ran, every decision with its policy, reason and metrics."""
    metrics, events = load_run(run_dir)
    last: dict = {}
    for r in metrics:
        last.update(r)
    lines = [f"# {_title(run_dir, metrics, events)}", ""]
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e.get("kind", "?")] = kinds.get(e.get("kind", "?"), 0) + 1
    lines += [
        f"- run directory: `{os.path.abspath(run_dir)}`",
        f"- steps logged: {metrics[-1]['step'] if metrics else 0}",
        "- events: " + (", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) or "none"),
        f"- compilations: {_compile_line(events, last)}",
        f"- {_skipped_line(metrics)}",
        "- last metrics: " + _seen({k: v for k, v in last.items() if k != "step"}, limit=12),
        "",
        "## Decisions",
        "",
    ]
    rows = decisions(events)
    if not rows:
        lines.append("No policy decided anything.")
    else:
        lines += [
            "| step | policy | action | reason | metrics it saw |",
            "|---:|---|---|---|---|",
        ]
        for r in rows:
            cell = lambda x: str(x).replace("|", "\\|").replace("\n", " ")  # noqa: E731
            lines.append(
                f"| {r['step']} | {cell(r['policy'] or '(not named)')} | `{cell(r['action'])}` | "
                f"{cell(r['reason'] or '(no reason recorded)')} | "
                f"{cell(_seen(r['metrics'], _SEEN) or '(not recorded)')} "
                f"(step {r['metrics_step']}) |"
            )
    lines += probe_lines(events, last)
    lines += ["", "## Other events", ""]
    quiet = ("decision", "compile", "eval", "checkpoint", "probe")
    other = [e for e in events if e.get("kind") not in quiet]
    for e in other:
        detail = ", ".join(f"{k}={_fmt(v)}" for k, v in e.items()
                           if k not in ("time", "kind", "step", "config"))
        lines.append(f"- step {e.get('step')}: **{e.get('kind')}** {detail}")
    checkpoints = [e["step"] for e in events if e.get("kind") == "checkpoint"]
    lines.append(f"- checkpoints at steps {checkpoints}" if checkpoints else "- no checkpoints")
    evals = [e for e in events if e.get("kind") == "eval"]
    if evals:
        lines += ["", "## Evaluations", "", "| step | " + " | ".join(
            k for k in evals[0] if k.startswith("eval_")) + " |",
            "|---:|" + "---:|" * sum(1 for k in evals[0] if k.startswith("eval_"))]
        for e in evals:
            lines.append(f"| {e['step']} | " + " | ".join(
                _fmt(e[k]) for k in evals[0] if k.startswith("eval_") and k in e) + " |")
    return "\n".join(lines) + "\n"


def _skipped_line(metrics: list[dict], shown: int = 10) -> str:
    """``steps skipped as non-finite: 2 (steps 14, 15)``: the guard's skips, from the metrics."""
    skipped = [r["step"] for r in metrics if r.get("nonfinite", 0) > 0]
    if not skipped:
        return "steps skipped as non-finite: none"
    more = f", ... {len(skipped) - shown} more" if len(skipped) > shown else ""
    listed = ", ".join(str(s) for s in skipped[:shown])
    return f"steps skipped as non-finite: {len(skipped)} (steps {listed}{more})"


def _compile_line(events: list[dict], last: dict) -> str:
    """``4 (3.1 s, 20% of the run's 15.0 s); 3 more in the background (9.7 s)``.

    The share is of the last row's ``train_seconds`` (the run's age, compiles
    included); compiles that found their program compiled ahead waited only
    for the rest of a background compile.
    """
    waits = event_latencies(events, "compile")
    age = last.get("train_seconds")
    share = ""
    if isinstance(age, int | float) and age > 0:
        share = f", {sum(waits) / age:.0%} of the run's {age:.1f} s"
    background = event_latencies(events, "background_compile")
    ahead = ""
    if background:
        ahead = f"; {len(background)} more in the background ({sum(background):.1f} s)"
    return f"{len(waits)} ({sum(waits):.1f} s{share}){ahead}"


def probe_lines(events: list[dict], last: dict) -> list[str]:
    """summary.md's section on critical-batch probes (``[]`` without any).

    Each probe's branches, the critical batch fitted and the noise scale the
    run measured at its step (their ratio is what the probe adds to the noise
    scale), and the probes' share of the run (``probe_seconds`` of
    ``train_seconds``).

    Example:
      >>> from adaptjax.cli._report import probe_lines
      >>> lines = probe_lines([{"kind": "probe", "step": 40, "batch_sizes": [8, 16, 32],
      ...                       "critical_batch": 60.0, "noise_scale": 30.0, "latency_s": 2.0}],
      ...                     {"probe_seconds": 2.0, "train_seconds": 20.0})
      >>> lines[-1]
      '| 40 | 8, 16, 32 | 60 | 30 | 2 | 2.0 |'
      >>> [line for line in lines if line.startswith("Probes took")]
      ['Probes took 2.0 s, 10% of the run (train_seconds 20.0 s).']
    """
    probes = [e for e in events if e.get("kind") in ("probe", "probe_skipped")]
    if not probes:
        return []
    out = ["", "## Critical-batch probes", ""]
    spent, age = last.get("probe_seconds"), last.get("train_seconds")
    if isinstance(spent, int | float) and isinstance(age, int | float) and age > 0:
        out += [f"Probes took {spent:.1f} s, {spent / age:.0%} of the run (train_seconds "
                f"{age:.1f} s).", ""]
    out += ["| step | batch sizes | critical batch | noise scale | ratio | seconds |",
            "|---:|---|---:|---:|---:|---:|"]
    for e in probes:
        if e["kind"] == "probe_skipped":
            out.append(f"| {e.get('step')} | skipped: {e.get('reason', '')} | | | | |")
            continue
        c, phi = e.get("critical_batch"), e.get("noise_scale")
        ratio = c / phi if isinstance(c, int | float) and isinstance(phi, int | float) and phi \
            else math.nan
        sizes = ", ".join(str(b) for b in e.get("batch_sizes", []))
        out.append(f"| {e.get('step')} | {sizes} | {_fmt(c)} | {_fmt(phi)} | {_fmt(ratio)} | "
                   f"{e.get('latency_s', math.nan):.1f} |")
    return out


def report(run_dir: str) -> tuple[str, str]:
    """Writes ``report.png`` and ``summary.md`` into ``run_dir``; returns both paths.

    Args:
      run_dir: the ``run_dir`` given to :class:`adaptjax.Controller`.

    Returns:
      ``(png_path, markdown_path)``.
    """
    md = os.path.join(run_dir, "summary.md")
    text = summary_markdown(run_dir)
    png = render(run_dir)
    with open(md, "w") as f:
        f.write(text)
    return png, md
