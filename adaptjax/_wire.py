"""Collective accounting from compiled HLO: what really crosses the wire.

`wire_bytes` lowers and compiles a jitted function once, reads every collective
(all-reduce, all-gather, all-to-all, reduce-scatter, collective-permute, and
their asynchronous ``-start`` forms) from the compiled HLO text, and reports the
bytes each device sends under the ring formulas. It is how adaptjax measures what
a compressor saves, instead of claiming it.

Bytes per device, with ``N`` the group size and ``S`` the per-device operand size
in bytes (summed over the operands of a tuple collective):

====================  ===================  =====================================
kind                  bytes per device     ``S`` is
====================  ===================  =====================================
all-reduce            ``2 (N-1)/N * S``    the operand (= the result)
all-gather            ``(N-1) * S``        the per-device operand (result / N)
all-to-all            ``(N-1)/N * S``      the operand (= the result)
reduce-scatter        ``(N-1)/N * S``      the full operand (result * N)
collective-permute    ``S``                the operand (0 if no device moves)
====================  ===================  =====================================

A group of one device sends nothing.

References:
  Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 2009 (ring all-reduce: 2(N-1)/N of the buffer per device).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

__all__ = ["Collective", "WireReport", "parse_collectives", "wire_bytes"]

KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
_REDUCING = ("all-reduce", "reduce-scatter")
_FLOATS = re.compile(r"^(bf16|f16|f\d+e\d+m\d+\w*|f4e2m1fn|f8\w*)$")

# --------------------------------------------------------------------------------------
# Public data types
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled program.

    A tuple collective (several operands moved by one instruction, e.g. after XLA's
    all-reduce combiner merged several all-reduces) is ONE `Collective`: ``shape``
    holds one shape per operand and ``elements``/``bytes`` are summed over them.

    Attributes:
      kind: ``"all-reduce"``, ``"all-gather"``, ``"all-to-all"``, ``"reduce-scatter"``
        or ``"collective-permute"`` (an async ``-start`` form reports its base kind).
      dtype: the program's element type, e.g. ``"bf16"``; operands of different types
        are joined in operand order without repeats, e.g. ``"f32,bf16"``.
      shape: the per-device operand shape, e.g. ``(1000,)``; for a tuple collective a
        tuple of shapes, one per operand (``num_operands > 1``).
      elements: per-device operand elements, summed over operands.
      group_size: devices in one replica group (``N``).
      bytes: bytes each device sends under the ring formula, at the program's dtype.
      compiled_bytes: the same at the dtype of the compiled program (differs from
        ``bytes`` only where XLA widened the collective, see `wire_bytes`).
      compiled_dtype: the element type in the compiled HLO.
      name: the instruction's name in the compiled HLO.
      is_async: whether it is an ``-start``/``-done`` pair.
      num_operands: operands of the instruction (1 unless it is a tuple collective).
      operand_dtypes: the program's dtype of each operand.
      branch: where it sits inside ``lax.cond``/``lax.switch`` branches: the
        ``(conditional name, branch index)`` pairs from the outermost in, ``()``
        when every call runs it.
      axes: the mesh axes its replica groups span, in mesh order (``("data",)``
        for the sync's all-reduce, ``("fsdp",)`` for an FSDP all-gather), read
        from the device ids of its groups; ``()`` when the mesh is unknown.
    """

    kind: str
    dtype: str
    shape: tuple
    elements: int
    group_size: int
    bytes: float
    compiled_bytes: float
    compiled_dtype: str
    name: str = ""
    is_async: bool = False
    num_operands: int = 1
    operand_dtypes: tuple[str, ...] = ()
    branch: tuple[tuple[str, int], ...] = ()
    axes: tuple[str, ...] = ()

    @property
    def widened(self) -> bool:
        """Whether XLA runs this collective at a wider dtype than the program asked."""
        return self.operand_dtypes != () and self.dtype != self.compiled_dtype


@dataclasses.dataclass(frozen=True)
class WireReport:
    """Every collective of a compiled program and the bytes each device sends.

    Collectives are counted statically: one inside a loop body counts once. A
    collective inside a branch of ``lax.cond``/``lax.switch`` (an HLO
    ``conditional``) runs only when its branch is taken, so the branches of a
    conditional are not added up: ``total`` takes their mean (what one call
    sends on average when the branches alternate, as PowerSGD's P and Q steps
    do with ``alternate=True``), ``max_total`` the largest, and ``branch_totals`` lists each branch.
    The non-finite guard of :func:`adaptjax.data_parallel_step` (a conditional
    whose other branch skips the update and sends nothing) is the exception:
    a step counts what its update sends.

    Attributes:
      collectives: the collectives in program-text order.
      num_devices: devices the program was compiled for (``None`` if unknown).
      conditionals: ``(name, number of branches)`` of every conditional that
        holds a collective (directly or nested), in program-text order.
    """

    collectives: tuple[Collective, ...]
    num_devices: int | None = None
    conditionals: tuple[tuple[str, int], ...] = ()

    @property
    def total(self) -> float:
        """Bytes each device sends per call, at the program's dtypes.

        Collectives outside any conditional, plus for each conditional the mean
        of its branches (the average per call when every branch is taken equally
        often); equals `static_total` for a program without conditionals.
        """
        return self._fold(lambda c: c.bytes, _mean)

    @property
    def max_total(self) -> float:
        """Bytes each device sends in the costliest call (the largest branch of each)."""
        return self._fold(lambda c: c.bytes, max)

    @property
    def static_total(self) -> float:
        """Every collective of the program text summed, every branch included."""
        return math.fsum(c.bytes for c in self.collectives)

    @property
    def compiled_total(self) -> float:
        """`total` at the dtypes of the compiled program (after XLA's widening)."""
        return self._fold(lambda c: c.compiled_bytes, _mean)

    def branch_totals(self, name: str | None = None) -> tuple[float, ...]:
        """Bytes per device of a call that takes each branch of one conditional.

        Each entry is the whole call's bytes when that branch is taken (outside
        collectives included; conditionals nested in it or elsewhere averaged).

        Args:
          name: the conditional's name in `conditionals`; ``None`` for the only one.

        Returns:
          One total per branch, in branch order (``lax.cond``: false, then true).
        """
        names = dict(self.conditionals)
        if name is None:
            if len(names) != 1:
                raise ValueError(
                    f"the program has {len(names)} conditionals with collectives: "
                    f"pass one of {sorted(names)} as name="
                )
            (name,) = names
        if name not in names:
            raise ValueError(
                f"no conditional {name!r} with collectives: use one of {sorted(names)}"
            )
        return tuple(
            self._fold(lambda c: c.bytes, _mean, fixed=(name, b)) for b in range(names[name])
        )

    def _fold(self, value, agg, fixed: tuple[str, int] | None = None) -> float:
        """Folds bytes over the branch tree: ``agg`` over each conditional's branches."""
        counts = dict(self.conditionals)

        def walk(prefix: tuple) -> float:
            here = [value(c) for c in self.collectives if c.branch == prefix]
            inner: dict[str, None] = {}
            for c in self.collectives:
                if len(c.branch) > len(prefix) and c.branch[: len(prefix)] == prefix:
                    inner.setdefault(c.branch[len(prefix)][0])
            for cond in inner:
                if fixed is not None and cond == fixed[0]:
                    here.append(walk((*prefix, fixed)))
                else:
                    here.append(agg([walk((*prefix, (cond, b))) for b in range(counts[cond])]))
            return math.fsum(here)

        return walk(())

    @property
    def axis_totals(self) -> dict[str, float]:
        """Bytes per device per call (as `total`) by the mesh axes each collective spans.

        Keys join the axes with ``+`` in mesh order (``"data"``, ``"fsdp"``,
        ``"data+fsdp"``); ``"?"`` holds collectives whose axes are unknown.
        On a sharded step ``"data"`` is the sync (and the monitors' scalars)
        and ``"fsdp"`` the compiler's all-gathers of weights and reductions of
        gradients.
        """
        # (a group of one device spans no axis and sends nothing: not listed)
        keys = dict.fromkeys(c.axes for c in self.collectives if c.axes or c.bytes)
        return {
            ("+".join(k) or "?"): self._fold(lambda c, k=k: c.bytes if c.axes == k else 0.0, _mean)
            for k in keys
        }

    def kind_totals(self, axes: str | None = None) -> dict[str, float]:
        """Bytes per device per call (as `total`) by collective kind, on ``axes`` (a key
        of `axis_totals`) or on every axis (``None``)."""
        want = None if axes is None else (() if axes == "?" else tuple(axes.split("+")))
        kinds = dict.fromkeys(c.kind for c in self.collectives)
        return {
            k: self._fold(
                lambda c, k=k: c.bytes if c.kind == k and want in (None, c.axes) else 0.0, _mean
            )
            for k in kinds
        }

    def count(self, kind: str | None = None, min_bytes: float = 0) -> int:
        """Number of collectives of ``kind`` (all kinds if None) sending >= ``min_bytes``.

        Args:
          kind: one of ``all-reduce``, ``all-gather``, ``all-to-all``, ``reduce-scatter``,
            ``collective-permute``, or None for every kind.
          min_bytes: count only collectives whose ``bytes`` are at least this.

        Returns:
          The number of matching collectives.
        """
        if kind is not None and kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}: use one of {', '.join(KINDS)}")
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        return sum(
            1 for c in self.collectives if (kind is None or c.kind == kind) and c.bytes >= min_bytes
        )

    def largest(self) -> Collective:
        """The collective sending the most bytes per device (the first one on a tie)."""
        if not self.collectives:
            raise ValueError("the program has no collectives: check report.count() first")
        return max(self.collectives, key=lambda c: c.bytes)

    def __str__(self) -> str:
        head = (
            f"WireReport: {len(self.collectives)} collective(s), "
            f"{_fmt(self.total)} B sent per device"
        )
        conds = [name for name, _ in self.conditionals]
        if conds:
            head += " per call (each conditional's branches averaged)"
        if self.compiled_total != self.total:
            head += f" ({_fmt(self.compiled_total)} B as compiled)"
        for i, name in enumerate(conds):
            per = ", ".join(_fmt(b) for b in self.branch_totals(name))
            head += f"\n  c{i} = {name}: a call taking branch 0, 1, ... sends {per} B"
        if conds:
            head += (
                f"\n  max {_fmt(self.max_total)} B per call; "
                f"all branches summed {_fmt(self.static_total)} B"
            )
        if not self.collectives:
            return head
        if any(c.axes for c in self.collectives):
            per = ", ".join(f"{k} {_fmt(v)}" for k, v in self.axis_totals.items())
            head += f"\n  by mesh axes: {per} B"
        rows = [("kind", "dtype", "shape", "N", "bytes", "compiled", "branch")]
        for c in self.collectives:
            dtype = c.dtype if c.compiled_dtype == c.dtype else f"{c.dtype}->{c.compiled_dtype}"
            rows.append(
                (
                    c.kind
                    + ("-start" if c.is_async else "")
                    + (f" [{'+'.join(c.axes)}]" if c.axes else ""),
                    dtype,
                    _fmt_shape(c.shape, c.num_operands),
                    str(c.group_size),
                    _fmt(c.bytes),
                    _fmt(c.compiled_bytes),
                    " ".join(f"c{conds.index(n)}:{b}" for n, b in c.branch),
                )
            )
        cols = 7 if conds else 6
        widths = [max(len(r[i]) for r in rows) for i in range(cols)]
        lines = [head]
        for r in rows:
            left = [r[i].ljust(widths[i]) for i in range(3)]
            right = [r[i].rjust(widths[i]) for i in range(3, 6)]
            tail = [r[6].ljust(widths[6])] if conds else []
            lines.append("  ".join(left + right + tail).rstrip())
        return "\n".join(lines)


def _mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs)


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _fmt_shape(shape: tuple, num_operands: int) -> str:
    if num_operands == 1:
        return "[" + ",".join(map(str, shape)) + "]"
    parts = ["[" + ",".join(map(str, s)) + "]" for s in shape]
    if len(parts) > 3:
        parts = parts[:2] + [f"...{len(parts) - 2} more"]
    return "(" + ", ".join(parts) + ")"


# --------------------------------------------------------------------------------------
# HLO text parsing
# --------------------------------------------------------------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_COLLECTIVE_OPCODE = re.compile(r"\s(?:" + "|".join(KINDS) + r")(?:-start)?\(")


@dataclasses.dataclass
class _Operand:
    dtype: str
    shape: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass
class _Instr:
    """A parsed HLO instruction (only what this module needs)."""

    name: str
    opcode: str
    shape: Any  # ("array", dtype, dims) or ("tuple", [children])
    operands: list[str]
    attrs: str
    computation: str


@dataclasses.dataclass
class _Coll:
    """A collective before widening is resolved."""

    kind: str
    name: str
    is_async: bool
    operands: list[_Operand]
    group_size: int
    instr: _Instr
    # each operand's dtype in the program (None until _resolve_widening matches it)
    program_dtypes: list[str | None] = dataclasses.field(default_factory=list)
    axes: tuple[str, ...] = ()


def _dtype_bits(dtype: str) -> int:
    if dtype == "pred":
        return 8
    if dtype in ("token", "opaque"):
        return 0
    m = re.match(r"^[a-z]+(\d+)", dtype)
    if m is None:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return int(m.group(1))


def _parse_shape(text: str, i: int) -> tuple[Any, int]:
    """Parses one HLO shape starting at ``text[i]``; returns (shape, next index)."""
    n = len(text)

    def skip(j: int) -> int:
        while j < n:
            if text[j].isspace():
                j += 1
            elif text.startswith("/*", j):
                end = text.find("*/", j)
                j = n if end < 0 else end + 2
            else:
                break
        return j

    i = skip(i)
    if i < n and text[i] == "(":
        children = []
        i = skip(i + 1)
        if i < n and text[i] == ")":
            return ("tuple", children), i + 1
        while True:
            child, i = _parse_shape(text, i)
            children.append(child)
            i = skip(i)
            if i < n and text[i] == ",":
                i += 1
                continue
            if i < n and text[i] == ")":
                return ("tuple", children), i + 1
            raise ValueError(f"cannot parse HLO tuple shape in {text[:120]!r}")
    m = _ARRAY.match(text, i)
    if m is None:
        raise ValueError(f"cannot parse HLO shape in {text[:120]!r}")
    dims_text = [d.strip().removeprefix("<=") for d in m.group(2).split(",") if d.strip()]
    if not all(d.isdigit() for d in dims_text):
        raise ValueError(f"cannot parse HLO shape in {text[:120]!r}")
    dims = tuple(int(d) for d in dims_text)
    i = m.end()
    if i < n and text[i] == "{":  # layout, may nest braces
        depth = 0
        while i < n:
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    i += 1
                    break
            i += 1
    return ("array", m.group(1), dims), i


def _leaves(shape: Any) -> list[_Operand]:
    if shape[0] == "array":
        return [_Operand(shape[1], shape[2])]
    out: list[_Operand] = []
    for child in shape[1]:
        out.extend(_leaves(child))
    return out


def _matching(text: str, i: int, open_: str, close: str) -> int:
    """Index just past the bracket that closes ``text[i]`` (an ``open_``)."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError(f"unbalanced {open_}{close} in HLO line {text[:120]!r}")


def _parse_module(text: str) -> tuple[list[_Instr], dict[str, int]]:
    """Instructions of every computation plus the module header's device counts."""
    header: dict[str, int] = {}
    instrs: list[_Instr] = []
    computation = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("HloModule"):
            for key in ("replica_count", "num_partitions"):
                m = re.search(rf"\b{key}=(\d+)", line)
                if m:
                    header[key] = int(m.group(1))
            continue
        m = _INSTR.match(line)
        if m is None:
            c = _COMP.match(line)
            if c is not None:
                computation = c.group(1)
            continue
        rest = m.group(2)
        try:
            shape, i = _parse_shape(rest, 0)
        except ValueError:
            if _COLLECTIVE_OPCODE.search(rest):
                raise
            continue  # not an instruction we need
        op = _OPCODE.match(rest, i)
        if op is None:
            continue
        start = op.end() - 1
        end = _matching(rest, start, "(", ")")
        inner = _COMMENT.sub("", rest[start + 1 : end - 1])
        operands = []
        for part in _split_top(inner):
            tokens = part.split()
            if tokens:
                operands.append(tokens[-1].lstrip("%"))
        instrs.append(_Instr(m.group(1), op.group(1), shape, operands, rest[end:], computation))
    return instrs, header


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p for p in parts if p.strip()]


def _attr_braces(attrs: str, key: str) -> str | None:
    """The balanced ``{...}`` value of ``key=`` in an attribute string, or None."""
    m = re.search(rf"\b{key}=\{{", attrs)
    if m is None:
        return None
    start = m.end() - 1
    return attrs[start : _matching(attrs, start, "{", "}")]


def _int_groups(braced: str) -> list[list[int]]:
    return [
        [int(x) for x in g.split(",") if x.strip()]
        for g in re.findall(r"\{([^{}]*)\}", braced[1:-1])
    ]


def _group_size(
    kind: str, attrs: str, header: dict[str, int], num_devices: int | None, line: str
) -> int:
    """The replica-group size ``N`` of a collective, under XLA's group-mode rules."""
    if kind == "collective-permute":
        braced = _attr_braces(attrs, "source_target_pairs")
        pairs = _int_groups(braced) if braced else []
        return len({d for p in pairs for d in p})

    # Mesh-axes form: replica_groups=mesh['a'=2,'b'=4] {'b'} (device ids are global).
    m = re.search(r"\breplica_groups=mesh\[([^\]]*)\]", attrs)
    if m is not None:
        sizes = dict(re.findall(r"'([^']*)'=(\d+)", m.group(1)))
        g = re.compile(r"\{([^{}]*)\}").search(attrs, m.end())
        if g is None:
            raise ValueError(f"cannot read the mesh replica groups of {line[:160]!r}")
        n = 1
        for axis in _split_top(g.group(1)):
            a = re.fullmatch(r"\s*'([^']*)'(?::\((\d+)\)(\d+))?\s*", axis)
            if a is None or a.group(1) not in sizes:
                raise ValueError(f"cannot read mesh axis {axis!r} of {line[:160]!r}")
            n *= int(a.group(3)) if a.group(3) else int(sizes[a.group(1)])
        return n

    # Iota form: replica_groups=[G,S]<=[...]T(...): G groups of S devices.
    m = re.search(r"\breplica_groups=\[(\d+(?:,\d+)*)\]<=", attrs)
    if m is not None:
        size = int(m.group(1).split(",")[-1])
    else:
        braced = _attr_braces(attrs, "replica_groups")
        groups = _int_groups(braced) if braced else []
        size = max((len(g) for g in groups), default=0)

    # XLA's CollectiveOpGroupMode: which ids the groups name, and what {} means.
    has_channel = re.search(r"\bchannel_id=", attrs) is not None
    global_ids = re.search(r"\buse_global_device_ids=true", attrs) is not None
    if not header:
        if size:
            return size
        if num_devices is None:
            raise ValueError(
                "replica_groups={} means every device, but the HLO has no "
                "num_partitions/replica_count: pass num_devices="
            )
        return num_devices
    replicas = header.get("replica_count", 1)
    partitions = header.get("num_partitions", 1)
    if not has_channel:  # cross-replica
        return size or replicas
    if kind == "all-to-all":  # cross-partition
        return size or partitions
    if global_ids:  # flattened ids
        return size or replicas * partitions
    return (size or replicas) * partitions  # cross-replica-and-partition


def _operands_of(kind: str, opcode: str, instr: _Instr, n: int, line: str) -> list[_Operand]:
    """Per-device operand shapes of a collective, from its result shape."""
    shape = instr.shape
    wrapped = shape[0] == "tuple" and shape[1] and shape[1][0][0] == "tuple"
    if opcode.endswith("-start") and (opcode != "all-reduce-start" or wrapped):
        # Async starts are (operands, results[, context...]): operands come first.
        if shape[0] != "tuple" or not shape[1]:
            raise ValueError(f"unexpected shape of async collective {line[:160]!r}")
        return _leaves(shape[1][0])
    results = _leaves(shape)
    if kind not in ("all-gather", "reduce-scatter") or n <= 0:
        return results
    m = re.search(r"\bdimensions=\{(\d+)", instr.attrs)
    dim = int(m.group(1)) if m else 0
    out = []
    for r in results:
        dims = list(r.shape)
        if not dims:
            raise ValueError(f"{kind} of a scalar in {line[:160]!r}")
        if kind == "all-gather":
            if dims[dim] % n:
                raise ValueError(f"all-gather result {dims} not divisible by N={n}: {line[:160]!r}")
            dims[dim] //= n
        else:
            dims[dim] *= n
        out.append(_Operand(r.dtype, tuple(dims)))
    return out


def _collectives(
    text: str, num_devices: int | None, mesh_axes: dict[str, int] | None = None
) -> tuple[list[_Coll], list[_Instr], dict]:
    instrs, header = _parse_module(text)
    colls = []
    for ins in instrs:
        opcode = ins.opcode
        is_async = opcode.endswith("-start")
        kind = opcode[: -len("-start")] if is_async else opcode
        if kind not in KINDS:
            continue
        line = f"{ins.name} = ... {opcode}(...){ins.attrs}"
        n = _group_size(kind, ins.attrs, header, num_devices, line)
        operands = _operands_of(kind, opcode, ins, n, line)
        axes = _group_axes(kind, ins.attrs, mesh_axes) if mesh_axes else ()
        colls.append(_Coll(kind, ins.name, is_async, operands, n, ins, axes=axes))
    return colls, instrs, header


# A conditional under this named scope is the non-finite guard of
# adaptjax.data_parallel_step: ``lax.cond(ok, update, skip)``. Its skip branch sends
# nothing and runs only on a rare bad step, so it is no branch point for the bytes:
# what the update branch sends is what a step sends.
GUARD_SCOPE = "adaptjax_nonfinite_guard"

_CALLED = re.compile(
    r"\b(?:calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)


def _branch_paths(instrs: list[_Instr]) -> tuple[dict[str, tuple], dict[str, int]]:
    """Each computation's enclosing ``(conditional, branch)`` path, and branch counts.

    A computation called as branch ``b`` of conditional ``C`` gets ``C``'s path
    plus ``(C, b)``; one called otherwise (fusion, loop body, async wrapper) its
    caller's path. ``lax.cond`` lowers to a conditional on ``int(pred)``, so the
    false branch is 0; a predicate conditional (``true_computation=``) is
    listed true first in the text and numbered the same way: false 0, true 1.
    A conditional under the named scope `GUARD_SCOPE` (the non-finite guard) is
    not a branch point: its branches get its own path.
    """
    parent: dict[str, tuple[str, tuple | None]] = {}
    counts: dict[str, int] = {}
    for ins in instrs:
        if ins.opcode == "conditional":
            braced = _attr_braces(ins.attrs, "branch_computations")
            if braced is not None:
                names = [b.strip().lstrip("%") for b in braced[1:-1].split(",") if b.strip()]
            else:
                t = re.search(r"\btrue_computation=%?([\w.\-]+)", ins.attrs)
                f = re.search(r"\bfalse_computation=%?([\w.\-]+)", ins.attrs)
                names = [f.group(1), t.group(1)] if t and f else []
            guard = re.search(r'op_name="[^"]*\b' + GUARD_SCOPE + r'/cond"', ins.attrs)
            if not guard:
                counts[ins.name] = len(names)
            for b, name in enumerate(names):
                parent.setdefault(name, (ins.computation, None if guard else (ins.name, b)))
            continue
        for name in _CALLED.findall(ins.attrs):
            parent.setdefault(name, (ins.computation, None))
    paths: dict[str, tuple] = {}

    def path(comp: str, seen: frozenset = frozenset()) -> tuple:
        if comp in paths:
            return paths[comp]
        if comp not in parent or comp in seen:
            return ()
        caller, step = parent[comp]
        out = path(caller, seen | {comp}) + ((step,) if step is not None else ())
        paths[comp] = out
        return out

    for comp in parent:
        path(comp)
    return paths, counts


def _ring_bytes(kind: str, n: int, s: float) -> float:
    """Bytes one device sends for a collective of ``kind`` over ``n`` devices."""
    if n <= 1 or s == 0:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) * s / n
    if kind == "all-gather":
        return float((n - 1) * s)
    if kind in ("all-to-all", "reduce-scatter"):
        return (n - 1) * s / n
    return float(s)  # collective-permute


def _permute_moves(c: _Coll) -> bool:
    braced = _attr_braces(c.instr.attrs, "source_target_pairs")
    return any(p[0] != p[1] for p in (_int_groups(braced) if braced else []) if len(p) == 2)


def _bytes(c: _Coll, dtypes: list[str]) -> float:
    s = sum(op.elements * _dtype_bits(d) / 8 for op, d in zip(c.operands, dtypes, strict=True))
    if c.kind == "collective-permute" and not _permute_moves(c):
        return 0.0
    return _ring_bytes(c.kind, c.group_size, s)


def _narrower(program: str, compiled: str) -> bool:
    return program != compiled and _dtype_bits(program) < _dtype_bits(compiled)


def _resolve_widening(
    compiled: list[_Coll], instrs: list[_Instr], program: list[_Coll] | None
) -> None:
    """Sets ``program_dtypes`` of each compiled collective (see `wire_bytes`)."""
    for c in compiled:
        c.program_dtypes = [None] * len(c.operands)
    program = program or []
    # one entry per operand of the program's collectives:
    # [kind, group size, dtype, elements, matched yet, index of its collective]
    pool = [
        [c.kind, c.group_size, op.dtype, op.elements, False, i]
        for i, c in enumerate(program)
        for op in c.operands
    ]
    # 1. Same dtype, operand by operand (also matches operands XLA combined into a tuple).
    # 2. A narrower dtype of the same kind, group size and element count: widened.
    for exact in (True, False):
        for c in compiled:
            for k, op in enumerate(c.operands):
                if c.program_dtypes[k] is not None:
                    continue
                ok = (
                    (lambda d, op=op: d == op.dtype)
                    if exact
                    else (lambda d, op=op: _narrower(d, op.dtype))
                )
                c.program_dtypes[k] = _take(pool, c.kind, c.group_size, op.elements, ok)
    # 3. An instruction XLA split into a tuple (e.g. all-to-all on CPU): match the sum.
    for c in compiled:
        _match_split(c, program, pool)
    # 4. Not in the program text (inserted by the SPMD partitioner): XLA's own marker.
    _match_promoted(compiled, instrs)


def _take(pool: list[list], kind, n, elements, accept) -> str | None:
    """The dtype of the first unmatched program operand that fits (marked matched)."""
    for p in pool:
        if not p[4] and p[0] == kind and p[1] == n and p[3] == elements and accept(p[2]):
            p[4] = True
            return p[2]
    return None


def _match_split(c: _Coll, program: list[_Coll], pool: list[list]) -> None:
    """Matches ``c``'s unmatched operands, together, to one program collective's sum."""
    left = [k for k, d in enumerate(c.program_dtypes) if d is None]
    if not left or len({c.operands[k].dtype for k in left}) != 1:
        return
    dtype = c.operands[left[0]].dtype
    total = sum(c.operands[k].elements for k in left)
    for i, p in enumerate(program):
        mine = [q for q in pool if q[5] == i]
        if (
            mine
            and p.kind == c.kind
            and p.group_size == c.group_size
            and not any(q[4] for q in mine)
            and len({q[2] for q in mine}) == 1
            and sum(q[3] for q in mine) == total
            and (mine[0][2] == dtype or _narrower(mine[0][2], dtype))
        ):
            for q in mine:
                q[4] = True
            for k in left:
                c.program_dtypes[k] = mine[0][2]
            return


def _match_promoted(compiled: list[_Coll], instrs: list[_Instr]) -> None:
    """The operands still unmatched: widened where XLA says so, else as compiled.

    Trusts XLA's own marker, a reduction computation renamed ``*_promoted``,
    and reads the source dtype from the convert that feeds the collective.
    """
    table = {(i.computation, i.name): i for i in instrs}
    by_name = {i.name: i for i in instrs}
    for c in compiled:
        promoted = re.search(r"\bto_apply=%?[\w.\-]*_promoted\b", c.instr.attrs) is not None
        for k, op in enumerate(c.operands):
            if c.program_dtypes[k] is not None:
                continue
            source = None
            if promoted and c.kind in _REDUCING and k < len(c.instr.operands):
                source = _source_dtype(c.instr.operands[k], c.instr.computation, op, table, by_name)
            c.program_dtypes[k] = source or op.dtype


def _source_dtype(name, computation, op, table, by_name) -> str | None:
    """The narrower dtype that a convert (or convert fusion) feeding ``op`` reads."""
    producer = table.get((computation, name)) or by_name.get(name)
    if producer is None:
        return None
    if producer.opcode not in ("convert", "fusion"):
        return None
    for arg in producer.operands:
        src = table.get((producer.computation, arg)) or by_name.get(arg)
        if src is None:
            continue
        for leaf in _leaves(src.shape):
            if (
                leaf.elements == op.elements
                and _FLOATS.match(leaf.dtype)
                and _narrower(leaf.dtype, op.dtype)
            ):
                return leaf.dtype
    return None


def _joined(dtypes: list[str]) -> str:
    return ",".join(dict.fromkeys(dtypes))


def _finish(c: _Coll, branch: tuple = ()) -> Collective:
    compiled = [op.dtype for op in c.operands]
    # _resolve_widening, when it ran, matched every operand (else its compiled dtype)
    resolved = zip(c.program_dtypes, compiled, strict=True) if c.program_dtypes else ()
    program = [d or op for d, op in resolved] or compiled
    shapes = tuple(op.shape for op in c.operands)
    return Collective(
        kind=c.kind,
        dtype=_joined(program),
        shape=shapes[0] if len(shapes) == 1 else shapes,
        elements=sum(op.elements for op in c.operands),
        group_size=c.group_size,
        bytes=_bytes(c, program),
        compiled_bytes=_bytes(c, compiled),
        compiled_dtype=_joined(compiled),
        name=c.name,
        is_async=c.is_async,
        num_operands=len(c.operands),
        operand_dtypes=tuple(program),
        branch=branch,
        axes=c.axes,
    )


def parse_collectives(
    hlo_text: str,
    num_devices: int | None = None,
    *,
    program_text: str | None = None,
    mesh_axes: dict[str, int] | None = None,
) -> tuple[Collective, ...]:
    r"""Reads every collective of an HLO module's text.

    Understands tuple operands, layouts, scalars, async ``-start``/``-done`` pairs
    (``-done`` is not counted again), and the replica-group syntaxes
    ``{{0,1,2,3},{4,5,6,7}}``, ``[2,4]<=[4,2]T(1,0)`` (iota), ``mesh['a'=2,'b'=4] {'b'}``
    and ``{}`` (every device: read from the module's ``replica_count`` /
    ``num_partitions``, or ``num_devices`` when the text has neither).

    Args:
      hlo_text: the module text, e.g. ``jax.jit(f).lower(x).compile().as_text()``.
      num_devices: devices in the program; used only for ``replica_groups={}`` in a
        module whose header does not say.
      program_text: optional pre-optimisation text of the same program
        (``lowered.as_text(dialect="hlo")``); if given, collectives XLA widened are
        reported at the program's dtype (the rule is in `wire_bytes`).
      mesh_axes: ``{axis: size}`` of the program's mesh in order (device id ``i``
        sits at ``numpy.unravel_index(i, sizes)``); if given, each collective's
        ``axes`` names the mesh axes its replica groups span.

    Returns:
      The collectives, in the order of the text.

    Example:
      >>> text = "\n".join([
      ...     "HloModule m, num_partitions=4",
      ...     "ENTRY e {",
      ...     "  p = f32[250]{0} parameter(0)",
      ...     "  ROOT s = f32[250]{0} all-reduce(p), channel_id=1, replica_groups=[1,4]<=[4],"
      ...     " use_global_device_ids=true, to_apply=add",
      ...     "}"])
      >>> (c,) = parse_collectives(text)
      >>> c.kind, c.dtype, c.group_size, c.bytes == 2 * (4 - 1) / 4 * (250 * 4)
      ('all-reduce', 'f32', 4, True)
    """
    colls, instrs, header = _collectives(hlo_text, num_devices, mesh_axes)
    program = None
    if program_text is not None:
        if num_devices is None and header:
            num_devices = header.get("replica_count", 1) * header.get("num_partitions", 1)
        program, _, _ = _collectives(program_text, num_devices)
    _resolve_widening(colls, instrs, program)
    paths, _ = _branch_paths(instrs)
    return tuple(_finish(c, paths.get(c.instr.computation, ())) for c in colls)


# --------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------


def wire_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> WireReport:
    """Bytes each device sends in the collectives of a compiled jitted function.

    Lowers ``fn`` once for the example ``args`` (arrays or `jax.ShapeDtypeStruct`),
    compiles once, and reads every collective of the compiled HLO; nothing runs.
    Bytes follow the ring formulas of this module's docstring, per device.

    Widening rule: XLA on CPU runs a bf16 all-reduce / all-gather / all-to-all /
    reduce-scatter as f32 (converts around it). Each operand of a compiled
    collective is matched with a collective of the pre-optimisation text
    (``lowered.as_text(dialect="hlo")``) of the same kind, group size and element
    count: first one of the same dtype; failing that, one of a narrower dtype, which
    is then the operand's program dtype. A compiled tuple whose operands match no
    single one (an all-to-all XLA split into N pieces) is matched on its total.
    Collectives absent from the program text (inserted by the SPMD partitioner)
    count as widened only when XLA renamed their reduction ``*_promoted``; the
    source dtype is read from the convert feeding them. ``bytes`` is at the
    program's dtype, ``compiled_bytes`` at the compiled one. Combined collectives
    (one tuple all-reduce for several) are matched operand by operand.

    Args:
      fn: a ``jax.jit``-wrapped function (anything with ``.lower``), or an already
        lowered (``jax.stages.Lowered``) or compiled (``jax.stages.Compiled``) one.
      *args: example positional arguments for ``fn.lower``.
      **kwargs: example keyword arguments for ``fn.lower``.

    Returns:
      A `WireReport`; ``report.total`` is the bytes each device sends per call
      (the branches of a ``lax.cond``/``lax.switch`` averaged, not summed:
      ``report.max_total`` and ``report.branch_totals()`` give the rest).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> n = len(jax.devices())
      >>> mesh = Mesh(np.array(jax.devices()), ("d",))
      >>> psum = jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh,
      ...                      in_specs=P("d"), out_specs=P())
      >>> report = wire_bytes(jax.jit(psum), jax.ShapeDtypeStruct((100 * n,), jnp.float32))
      >>> report.total == 2 * (n - 1) / n * (100 * 4)
      True
      >>> wire_bytes(jax.jit(lambda x: 2 * x), jnp.ones(3)).total
      0.0
    """
    import jax  # here only: the cost model reads WireReport and Collective without jax

    if isinstance(fn, jax.stages.Compiled):
        if args or kwargs:
            raise ValueError("fn is already compiled: call wire_bytes(compiled) with no args")
        lowered, compiled = None, fn
    elif isinstance(fn, jax.stages.Lowered):
        if args or kwargs:
            raise ValueError("fn is already lowered: call wire_bytes(lowered) with no args")
        lowered, compiled = fn, fn.compile()
    elif hasattr(fn, "lower"):
        lowered = fn.lower(*args, **kwargs)
        compiled = lowered.compile()
    else:
        what = getattr(fn, "__name__", type(fn).__name__)
        raise ValueError(
            f"wire_bytes needs a jitted function, got {what!r}: "
            "wrap it in jax.jit, e.g. wire_bytes(jax.jit(fn), *args)"
        )
    text = compiled.as_text()
    if not text:
        raise ValueError("the compiled executable has no HLO text: use a jax.jit function")
    instrs, header = _parse_module(text)
    num_devices = None
    if header:
        num_devices = header.get("replica_count", 1) * header.get("num_partitions", 1)
    program_text = lowered.as_text(dialect="hlo") if lowered is not None else None
    collectives = parse_collectives(
        text, num_devices, program_text=program_text, mesh_axes=_compiled_mesh_axes(compiled)
    )
    _, counts = _branch_paths(instrs)
    used = dict.fromkeys(name for c in collectives for name, _ in c.branch)
    return WireReport(collectives, num_devices, tuple((name, counts[name]) for name in used))


# --------------------------------------------------------------------------------------
# Which mesh axes a collective spans
# --------------------------------------------------------------------------------------


def _compiled_mesh_axes(compiled) -> dict[str, int] | None:
    """``{axis: size}`` of the mesh of the first ``NamedSharding`` among a compiled
    program's input and output shardings, or ``None``."""
    import jax

    trees = []
    for attr in ("input_shardings", "output_shardings"):
        try:
            trees.append(getattr(compiled, attr))
        except Exception:  # noqa: BLE001 - some executables cannot say
            continue
    for leaf in jax.tree.leaves(trees, is_leaf=lambda x: hasattr(x, "mesh")):
        mesh = getattr(leaf, "mesh", None)
        if mesh is not None and getattr(mesh, "axis_names", None) and mesh.size > 1:
            return {name: int(mesh.shape[name]) for name in mesh.axis_names}
    return None


def _iota_groups(attrs: str) -> list[list[int]] | None:
    """The groups of ``replica_groups=[G,S]<=[dims]T(perm)`` (iota form), or ``None``."""
    m = re.search(
        r"\breplica_groups=\[(\d+(?:,\d+)*)\]<=\[(\d+(?:,\d+)*)\](?:T\((\d+(?:,\d+)*)\))?",
        attrs,
    )
    if m is None:
        return None
    import numpy as np

    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(-1, shape[-1]).tolist()


def _group_axes(kind: str, attrs: str, mesh_axes: dict[str, int]) -> tuple[str, ...]:
    """The axes of ``mesh_axes`` whose coordinate differs within a replica group."""
    if re.search(r"\breplica_groups=mesh\[", attrs):
        groups = _mesh_form_groups(attrs)
    elif kind == "collective-permute":
        braced = _attr_braces(attrs, "source_target_pairs")
        groups = _int_groups(braced) if braced else []
    else:
        groups = _iota_groups(attrs)
        if groups is None:
            braced = _attr_braces(attrs, "replica_groups")
            groups = _int_groups(braced) if braced else []
    if groups is None:
        return ()
    sizes = list(mesh_axes.values())
    total = math.prod(sizes)
    if not groups or not any(groups):
        return tuple(a for a, n in mesh_axes.items() if n > 1)  # every device
    varying: set[int] = set()
    for group in groups:
        if any(i >= total for i in group):
            return ()
        coords = [_unravel(i, sizes) for i in group]
        for d in range(len(sizes)):
            if len({c[d] for c in coords}) > 1:
                varying.add(d)
    names = list(mesh_axes)
    return tuple(names[d] for d in sorted(varying))


def _mesh_form_groups(attrs: str) -> list[list[int]] | None:
    """The device groups of ``replica_groups=mesh['a'=2,'b'=4][, device_ids=...] {'b'}``.

    The HLO's own mesh (its axis names need not be the program's): devices
    ``device_ids`` (an iota, default ``0..N-1``) laid out in its shape; a group
    is the devices along the named axes (``'x':(p)s`` names the sub-axis of
    size ``s`` after ``p``) for fixed coordinates of the others.
    """
    import numpy as np

    m = re.search(r"\breplica_groups=mesh\[([^\]]*)\]", attrs)
    if m is None:
        return None
    axes = [(a, int(n)) for a, n in re.findall(r"'([^']*)'=(\d+)", m.group(1))]
    rest = attrs[m.end() :]
    g = re.search(r"\{([^{}]*)\}", rest)
    if g is None:
        return None
    total = math.prod(n for _, n in axes)
    ids = np.arange(total)
    d = re.match(r"\s*,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", rest)
    if d is not None:
        ids = ids.reshape([int(x) for x in d.group(1).split(",")])
        if d.group(2):
            ids = ids.transpose([int(x) for x in d.group(2).split(",")])
        ids = ids.reshape(-1)
    # split every axis into sub-axes where a group names one: (before, size, after)
    shape, names = [], []
    picked = {}
    for part in _split_top(g.group(1)):
        a = re.fullmatch(r"\s*'([^']*)'(?::\((\d+)\)(\d+))?\s*", part)
        if a is None:
            return None
        picked[a.group(1)] = (int(a.group(2)), int(a.group(3))) if a.group(3) else None
    for name, n in axes:
        sub = picked.get(name)
        if sub is None:
            shape.append(n)
            names.append((name, name in picked))
        else:
            pre, size = sub
            shape += [pre, size, n // (pre * size)]
            names += [(name, False), (name, True), (name, False)]
    grid = ids.reshape(shape)
    inside = [k for k, (_, chosen) in enumerate(names) if chosen]
    outside = [k for k in range(len(shape)) if k not in inside]
    grid = grid.transpose(outside + inside)
    return grid.reshape(-1, math.prod(shape[k] for k in inside) if inside else 1).tolist()


def _unravel(i: int, sizes: list[int]) -> tuple[int, ...]:
    out = []
    for n in reversed(sizes):
        out.append(i % n)
        i //= n
    return tuple(reversed(out))
