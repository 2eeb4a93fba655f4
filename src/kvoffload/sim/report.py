"""Reports of a capacity plan: a text table, a CSV file and a hit-ratio-vs-capacity plot.

The CSV holds one row per (policy, capacity) with every ``PlanRow`` field (with a disk
tier: per (policy, CPU capacity, disk capacity), every ``DiskPlanRow`` field). The plot
draws the total hit ratio against the host capacity, one curve per policy; ``belady`` is
drawn dashed, as the ceiling. With a disk tier it draws the total hit ratio (device + CPU +
disk) against the disk capacity, one curve per (policy, CPU capacity). Capacities are
placed by their size in blocks (log scale for more than two) and labelled as they were
typed (``5%``, ``64GiB``, ``2000``). Matplotlib is imported only by the plot writers and
always with the non-interactive Agg backend.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

from kvoffload.extras import require
from kvoffload.sim.disk_plan import DiskPlanRow
from kvoffload.sim.planning import BELADY, PlanRow

_GB = 1e9


def format_table(rows: Sequence[PlanRow]) -> str:
    """A fixed-width table of the rows."""
    header = (
        f"{'policy':<10}{'capacity':>10}{'blocks':>9}{'device':>8}{'host':>8}{'total':>8}"
        f"{'tokens saved':>14}{'GB loaded':>11}{'GB stored':>11}{'prefill s saved':>17}{'req/s':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.policy:<10}{r.capacity:>10}{r.blocks:>9}{r.device_hit_ratio:>8.3f}{r.host_hit_ratio:>8.3f}"
            f"{r.hit_ratio:>8.3f}{r.device_tokens_saved + r.host_tokens_saved:>14,}"
            f"{r.bytes_loaded / _GB:>11.1f}{r.bytes_stored / _GB:>11.1f}{r.prefill_s_saved:>17,.1f}"
            f"{r.requests_per_second:>10,.0f}"
        )
    return "\n".join(lines)


def _gb(n: int) -> str:
    gb = n / _GB
    return f"{gb:,.0f}" if gb >= 100 else f"{gb:.1f}"


def format_disk_table(rows: Sequence[DiskPlanRow]) -> str:
    """A fixed-width table of CPU + disk rows: hit ratio and GB read/written per tier (and
    the object tier's, when the rows have one)."""
    objects = any(r.object_blocks for r in rows)
    header = (
        f"{'policy':<10}{'cpu':>9}{'disk':>9}{'device':>8}{'cpu':>7}{'disk':>7}"
        + (f"{'object':>8}" if objects else "")
        + f"{'total':>7}{'tokens saved':>15}{'cpu GB r/w':>17}{'disk GB r/w':>17}"
        + (f"{'object GB r/w':>17}" if objects else "")
        + f"{'prefill s saved':>17}{'req/s':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        cpu_rw = f"{_gb(r.cpu_bytes_read)}/{_gb(r.cpu_bytes_written)}"
        disk_rw = f"{_gb(r.disk_bytes_read)}/{_gb(r.disk_bytes_written)}"
        object_rw = f"{_gb(r.object_bytes_read)}/{_gb(r.object_bytes_written)}"
        tokens = r.device_tokens_saved + r.cpu_tokens_saved + r.disk_tokens_saved + r.object_tokens_saved
        lines.append(
            f"{r.policy:<10}{r.capacity:>9}{r.disk_capacity:>9}{r.device_hit_ratio:>8.3f}"
            f"{r.cpu_hit_ratio:>7.3f}{r.disk_hit_ratio:>7.3f}"
            + (f"{r.object_hit_ratio:>8.3f}" if objects else "")
            + f"{r.hit_ratio:>7.3f}{tokens:>15,}{cpu_rw:>17}{disk_rw:>17}"
            + (f"{object_rw:>17}" if objects else "")
            + f"{r.prefill_s_saved:>17,.1f}{r.requests_per_second:>9,.0f}"
        )
    return "\n".join(lines)


def write_csv(rows: Sequence[PlanRow] | Sequence[DiskPlanRow], path: str | Path) -> None:
    """Write every field of every row (``PlanRow``s or ``DiskPlanRow``s), plus requests per
    second."""
    kind = type(rows[0]) if rows else PlanRow
    names = [f.name for f in dataclasses.fields(kind)] + ["requests_per_second"]
    with Path(path).open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(names)
        for row in rows:
            values = dataclasses.asdict(row)
            values["requests_per_second"] = row.requests_per_second
            writer.writerow([_csv_value(values[name]) for name in names])


def _csv_value(value: object) -> object:
    return f"{value:.6g}" if isinstance(value, float) else value


def capacity_ticks(points: Sequence[tuple[float, str]]) -> tuple[list[float], list[str]]:
    """Tick positions and labels of (position, typed capacity) pairs: one tick per distinct
    position, in increasing order, labelled with every capacity typed for it."""
    labels: dict[float, list[str]] = {}
    for x, text in points:
        names = labels.setdefault(x, [])
        if text not in names:
            names.append(text)
    xs = sorted(labels)
    return xs, [" / ".join(labels[x]) for x in xs]


def _staggered(positions: Sequence[float], names: Sequence[str], log: bool) -> list[str]:
    """``names``, each label too close to the one before it a line lower than that one (up
    to three lines, then back to the top)."""
    if len(positions) < 2:
        return list(names)
    scale = math.log if log else float
    lo, hi = scale(positions[0]), scale(positions[-1])
    out, last, level = [], -1.0, 0
    for x, name in zip(positions, names):
        at = (scale(x) - lo) / (hi - lo)
        level = (level + 1) % 3 if at - last < 0.08 else 0
        out.append("\n" * level + name)
        last = at
    return out


def _draw(path, title, xlabel, ylabel, ticks, curves) -> list[str]:
    """Draw ``curves`` ([(label, xs, ys, dashed)]) with ``ticks`` as the x tick labels; the
    tick labels drawn are returned."""
    matplotlib = require("matplotlib", "plot", "drawing the simulator's plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for label, xs, ys, dashed in curves:
            if dashed:
                ax.plot(xs, ys, "k--", marker="o", label=label)
            else:
                ax.plot(xs, ys, marker="o", label=label)
        positions, names = ticks
        log = len(positions) > 2 and positions[0] > 0
        if log:
            ax.set_xscale("log")
        ax.set_xticks(positions, _staggered(positions, names, log))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
        if title:
            ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return [t.get_text().strip("\n") for t in ax.get_xticklabels()]
    finally:
        plt.close(fig)


def write_plot(rows: Sequence[PlanRow], path: str | Path, title: str = "") -> list[str]:
    """Hit ratio against host capacity, one curve per policy, Belady dashed as the ceiling;
    returns the x tick labels drawn (the capacities as typed)."""
    curves = []
    for policy in dict.fromkeys(r.policy for r in rows):
        points = sorted((r.blocks, r.hit_ratio) for r in rows if r.policy == policy)
        xs, ys = [x for x, _ in points], [y for _, y in points]
        dashed = policy.lower() == BELADY
        curves.append(("belady (offline ceiling)" if dashed else policy, xs, ys, dashed))
    ticks = capacity_ticks([(r.blocks, r.capacity) for r in rows])
    return _draw(path, title, "host tier capacity", "hit ratio (device + host)", ticks, curves)


def write_disk_plot(rows: Sequence[DiskPlanRow], path: str | Path, title: str = "") -> list[str]:
    """Total hit ratio against disk capacity, one curve per (policy, CPU capacity); returns
    the x tick labels drawn (the disk capacities as typed)."""
    curves = []
    for policy, capacity in dict.fromkeys((r.policy, r.capacity) for r in rows):
        mine = [r for r in rows if r.policy == policy and r.capacity == capacity]
        points = sorted((r.disk_blocks, r.hit_ratio) for r in mine)
        curves.append((f"{policy}, CPU {capacity}", [x for x, _ in points], [y for _, y in points], False))
    ticks = capacity_ticks([(r.disk_blocks, r.disk_capacity) for r in rows])
    return _draw(path, title, "disk tier capacity", "hit ratio (device + CPU + disk)", ticks, curves)
