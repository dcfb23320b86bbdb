"""Reading a run's ``events.jsonl`` rows (shared by the controller's log, the CLI and the
cost model)."""

from __future__ import annotations


def event_latencies(events: list[dict], kind: str) -> list[float]:
    """``latency_s`` of each event of ``kind`` that has one (a failed compile has none).

    Example:
      >>> from adaptjax._events import event_latencies
      >>> event_latencies([{"kind": "compile", "latency_s": 2.5}, {"kind": "compile"},
      ...                  {"kind": "eval", "latency_s": 1.0}], "compile")
      [2.5]
    """
    return [
        float(e["latency_s"]) for e in events
        if e.get("kind") == kind and isinstance(e.get("latency_s"), int | float)
    ]
