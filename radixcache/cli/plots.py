"""The plots of ``simulate --plot``: hit rate against capacity (per eviction policy, or per
router for a fleet) and against host memory. matplotlib is imported only to draw one."""

from __future__ import annotations

import os
from typing import Any, Sequence

from .._options import POOLED
from .args import UsageError
from .output import atomic_write, short_count

# Plot size in inches at PLOT_DPI: the PNG is 800 x 500 pixels.
PLOT_SIZE = (8, 5)
PLOT_DPI = 100


def _finish_plot(path: str, fig: Any, ax: Any, rows: list[dict], xlabel: str, title: str,
                 legend_title: str) -> None:
    """Axes shared by both plots (hit rate against capacity), then the atomic PNG write."""
    from matplotlib.ticker import NullLocator  # noqa: PLC0415

    capacities = sorted({r["capacity"] for r in rows})
    if capacities[-1] >= 10 * capacities[0]:
        ax.set_xscale("log")
    # Ticks at the measured capacities only, in readable units.
    ax.set_xticks(capacities, [short_count(c) for c in capacities])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(xlabel)
    ax.set_ylabel("prefix cache hit rate (%)")
    ax.set_ylim(*hit_rate_limits([r["hit_rate"] for r in rows]))
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(title=legend_title)
    _save(fig, path)


def hit_rate_limits(hit_rates: Sequence[float]) -> tuple[float, float]:
    """The y range (percent) for these hit rates: the data with 10% of its span (at least 1
    point) of headroom either side, within 0..100."""
    low, high = 100 * min(hit_rates), 100 * max(hit_rates)
    pad = max(0.1 * (high - low), 1.0)
    return max(0.0, low - pad), min(100.0, high + pad)


def _plot_formats() -> dict[str, str]:
    """The file formats matplotlib can write here: extension -> description."""
    from matplotlib.figure import Figure  # noqa: PLC0415

    return Figure().canvas.get_supported_filetypes()


def plot_format(path: str) -> str:
    """The format --plot's extension names; UsageError when it names none matplotlib writes."""
    extension = os.path.splitext(path)[1].lower().lstrip(".")
    formats = _plot_formats()
    if extension not in formats:
        what = f"extension '.{extension}'" if extension else "no extension"
        raise UsageError(f"--plot: {path!r} has {what}; use one of "
                         + ", ".join("." + f for f in sorted(formats)))
    return extension


def write_plot(path: str, rows: list[dict], trace_name: str, page_size: int) -> None:
    # Figure without pyplot renders PNG through the Agg canvas: no GUI backend involved.
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=PLOT_SIZE, dpi=PLOT_DPI)
    ax = fig.add_subplot()
    # One line per eviction policy (and write policy, when a host tier has several).
    policies = list(dict.fromkeys((r["policy"], r.get("write_policy")) for r in rows))
    several = len({w for _, w in policies}) > 1
    markers, styles = "os^Dvx*", ("-", "--", "-.", ":")
    for i, (policy, write_policy) in enumerate(policies):
        points = sorted((r["capacity"], r["hit_rate"]) for r in rows if r["policy"] == policy
                        and r.get("write_policy") == write_policy)
        # Policies often tie: shrinking markers and varied dashes keep every line visible.
        ax.plot([c for c, _ in points], [100 * h for _, h in points],
                label=f"{policy}, {write_policy}" if several else policy,
                marker=markers[i % len(markers)], linestyle=styles[i % len(styles)],
                markersize=max(3, 10 - 1.5 * i), fillstyle="none" if i % 2 else "full")
    _finish_plot(path, fig, ax, rows, "KV pool capacity (token slots)",
                 f"Prefix cache hit rate vs capacity: {trace_name} (page size {page_size})",
                 "eviction policy")


def write_fleet_plot(path: str, rows: list[dict], trace_name: str, page_size: int,
                     workers: int) -> None:
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=PLOT_SIZE, dpi=PLOT_DPI)
    ax = fig.add_subplot()
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    lines = list(dict.fromkeys((r["router"], r["policy"], r.get("write_policy")) for r in rows))
    several = len({line[2] for line in lines}) > 1  # write policies of a host tier
    markers = "os^Dvx*"
    routers = [name for name in dict.fromkeys(r["router"] for r in rows) if name != POOLED]
    for router, policy, write_policy in lines:
        points = sorted((r["capacity"], r["hit_rate"]) for r in rows
                        if r["router"] == router and r["policy"] == policy
                        and r.get("write_policy") == write_policy)
        label = router if len(policies) == 1 else f"{router} ({policy})"
        if several:
            label += f", {write_policy}"
        if router == POOLED:
            label = f"pooled: one cache of {workers} x capacity" + (
                "" if len(policies) == 1 else f" ({policy})")
            # Dashed and grey; with several policies a shade and marker per policy.
            p = policies.index(policy)
            style = dict(linestyle="--", color=("black", "dimgray", "gray", "darkgray")[p % 4],
                         marker=None if len(policies) == 1 else markers[p % len(markers)])
        else:
            i = routers.index(router)
            style = dict(linestyle="-", marker=markers[i % len(markers)])
        ax.plot([c for c, _ in points], [100 * h for _, h in points], label=label, **style)
    _finish_plot(path, fig, ax, rows, "KV pool capacity per worker (token slots)",
                 f"Hit rate over {workers} workers by router: {trace_name} (page {page_size})",
                 "router")


def write_host_plot(path: str, rows: list[dict], trace_name: str, page_size: int,
                    workers: int = 1) -> None:
    """Hit rate against host capacity: one line per device capacity (and eviction policy,
    write policy and router when there are several); host 0 (no host tier) starts every line."""
    from matplotlib.figure import Figure  # noqa: PLC0415
    from matplotlib.ticker import NullLocator  # noqa: PLC0415

    fig = Figure(figsize=PLOT_SIZE, dpi=PLOT_DPI)
    ax = fig.add_subplot()
    capacities = list(dict.fromkeys(r["capacity"] for r in rows))
    varying = [key for key in ("policy", "write_policy", "router")
               if len({r.get(key) for r in rows if r["host_capacity"]}) > 1]
    lines = list(dict.fromkeys((r["capacity"], *(r.get(k) for k in varying))
                               for r in rows if r["host_capacity"]))
    markers, styles = "os^Dvx*", ("-", "--", "-.", ":")
    others = list(dict.fromkeys(line[1:] for line in lines))
    for line in lines:
        capacity, rest = line[0], dict(zip(varying, line[1:]))

        def on_line(r: dict, host_too: bool) -> bool:
            return r["capacity"] == capacity and all(
                r.get(k) == v for k, v in rest.items() if host_too or k != "write_policy")

        points = sorted((r["host_capacity"], r["hit_rate"]) for r in rows
                        if on_line(r, bool(r["host_capacity"])))
        label = f"device {short_count(capacity)}" + "".join(
            f", {v}" for v in rest.values())
        i, j = capacities.index(capacity), others.index(line[1:])
        ax.plot([h for h, _ in points], [100 * h for _, h in points], label=label,
                marker=markers[i % len(markers)], linestyle=styles[j % len(styles)],
                color=f"C{i}" if len(others) > 1 else None)
    hosts = sorted({r["host_capacity"] for r in rows})
    positive = [h for h in hosts if h]
    if positive and positive[-1] >= 10 * positive[0]:
        ax.set_xscale("symlog", linthresh=positive[0])
    ax.set_xticks(hosts, [short_count(h) for h in hosts])
    ax.xaxis.set_minor_locator(NullLocator())
    per = " per worker" if workers > 1 else ""
    ax.set_xlabel(f"host memory{per} (token slots; 0: no host tier)")
    ax.set_ylabel("prefix cache hit rate, device + host (%)")
    ax.set_ylim(*hit_rate_limits([r["hit_rate"] for r in rows]))
    fleet = f" over {workers} workers" if workers > 1 else ""
    ax.set_title(f"Hit rate vs host memory{fleet}: {trace_name} (page {page_size})")
    ax.grid(True, alpha=0.3)
    ax.legend(title="device capacity" + per, fontsize="small")
    _save(fig, path)


def _save(fig: Any, path: str) -> None:
    """Lay the figure out and write it atomically, in the format ``path``'s extension names."""
    fig.tight_layout()
    file_format = plot_format(path)
    atomic_write(path, lambda temp_path: fig.savefig(temp_path, format=file_format,
                                                     dpi=PLOT_DPI))
