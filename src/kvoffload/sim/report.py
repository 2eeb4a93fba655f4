"""Reports of a capacity plan: a text table, a CSV file and a hit-ratio-vs-capacity plot.

The CSV holds one row per (policy, capacity) with every ``PlanRow`` field. The plot draws
the total hit ratio (device + host) against the host capacity as a fraction of the unique
blocks, one curve per policy; ``belady`` is drawn dashed, as the ceiling. Matplotlib is
imported only by ``write_plot`` and always with the non-interactive Agg backend.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Sequence
from pathlib import Path

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


def write_csv(rows: Sequence[PlanRow], path: str | Path) -> None:
    """Write every field of every row, plus requests per second."""
    names = [f.name for f in dataclasses.fields(PlanRow)] + ["requests_per_second"]
    with Path(path).open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(names)
        for row in rows:
            values = dataclasses.asdict(row)
            values["requests_per_second"] = row.requests_per_second
            writer.writerow([_csv_value(values[name]) for name in names])


def _csv_value(value: object) -> object:
    return f"{value:.6g}" if isinstance(value, float) else value


def write_plot(rows: Sequence[PlanRow], path: str | Path, title: str = "") -> None:
    """Hit ratio against capacity, one curve per policy, Belady dashed as the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for policy in dict.fromkeys(r.policy for r in rows):
            points = sorted((r.fraction, r.hit_ratio) for r in rows if r.policy == policy)
            xs, ys = [100 * x for x, _ in points], [y for _, y in points]
            if policy.lower() == BELADY:
                ax.plot(xs, ys, "k--", marker="o", label="belady (offline ceiling)")
            else:
                ax.plot(xs, ys, marker="o", label=policy)
        ax.set_xlabel("host tier capacity (% of unique blocks)")
        ax.set_ylabel("hit ratio (device + host)")
        if len({r.fraction for r in rows}) > 2:
            ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
        if title:
            ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
