"""The plots of ``simulate --plot``: hit rate against capacity (per eviction policy, or per
router for a fleet) and against host memory. matplotlib is imported only to draw one."""

from __future__ import annotations

import os
from typing import Any, Sequence

from .._options import POOLED
from .errors import UsageError
from .output import atomic_write, short_count

# Plot size in inches at PLOT_DPI: the PNG is 1000 x 500 pixels (the legend is beside the
# axes, on the right).
PLOT_SIZE = (10, 5)
PLOT_DPI = 100

# Every series of a plot gets its own marker (and colour, see ``_series_style``).
_MARKERS = "osD^vP*Xph<>"
_LINE_STYLES = ("-", "--", "-.", ":")
# The pooled bound of a fleet: a grey per series, dashed.
_GREYS = ("black", "dimgray", "gray", "darkgray")
# What each column a host plot's lines may vary in is called in its legend title.
_COLUMN_NAMES = {"policy": "eviction policy", "write_policy": "write policy", "router": "router"}


def _palette(n: int) -> list:
    """``n`` distinct colours (repeating only past 20)."""
    from matplotlib import colormaps

    return list(colormaps["tab10" if n <= 10 else "tab20"].colors)


def _series_style(i: int, n: int, color: Any) -> dict:
    """Series ``i`` of ``n``: its colour and its own marker, hollow and shrinking with ``i``,
    so that where series coincide each one's outline still shows."""
    return dict(color=color, marker=_MARKERS[i % len(_MARKERS)],
                markersize=10 - 4 * i / max(n - 1, 1), fillstyle="none",
                markeredgewidth=1.5)


def _legend(ax: Any, title: str) -> None:
    """The legend beside the axes, never over the data, titled with what its entries are."""
    ax.legend(title=title, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
              fontsize="small", title_fontsize="small", alignment="left")


def _finish_plot(path: str, fig: Any, ax: Any, rows: list[dict], xlabel: str, title: str,
                 legend_title: str) -> None:
    """Axes shared by both plots (hit rate against capacity), then the atomic PNG write."""
    from matplotlib.ticker import NullLocator

    capacities = sorted({r["capacity"] for r in rows})
    if capacities[-1] >= 10 * capacities[0]:
        ax.set_xscale("log")
    # Ticks at the measured capacities only, in readable units.
    ax.set_xticks(capacities, [short_count(c) for c in capacities])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(xlabel)
    ax.set_ylabel("prefix cache hit rate (%)")
    ax.set_ylim(*hit_rate_limits([r["hit_rate"] for r in rows]))
    fig.suptitle(title)  # over the figure: the axes leave room for the legend
    ax.grid(True, alpha=0.3)
    _legend(ax, legend_title)
    _save(fig, path)


def hit_rate_limits(hit_rates: Sequence[float]) -> tuple[float, float]:
    """The y range (percent) for these hit rates: the data with 10% of its span (at least 1
    point) of headroom either side, within 0..100."""
    low, high = 100 * min(hit_rates), 100 * max(hit_rates)
    pad = max(0.1 * (high - low), 1.0)
    return max(0.0, low - pad), min(100.0, high + pad)


def _plot_formats() -> dict[str, str]:
    """The file formats matplotlib can write here: extension -> description."""
    from matplotlib.figure import Figure

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
    from matplotlib.figure import Figure

    fig = Figure(figsize=PLOT_SIZE, dpi=PLOT_DPI)
    ax = fig.add_subplot()
    # One line per eviction policy (and write policy, when a host tier has several).
    policies = list(dict.fromkeys((r["policy"], r.get("write_policy")) for r in rows))
    several = len({w for _, w in policies}) > 1
    colors = _palette(len(policies))
    for i, (policy, write_policy) in enumerate(policies):
        points = sorted((r["capacity"], r["hit_rate"]) for r in rows if r["policy"] == policy
                        and r.get("write_policy") == write_policy)
        # Policies often tie: varied dashes and nested markers keep every line visible.
        ax.plot([c for c, _ in points], [100 * h for _, h in points],
                label=f"{policy}, {write_policy}" if several else policy,
                linestyle=_LINE_STYLES[i % len(_LINE_STYLES)],
                **_series_style(i, len(policies), colors[i % len(colors)]))
    _finish_plot(path, fig, ax, rows, "KV pool capacity (token slots)",
                 f"Prefix cache hit rate vs capacity: {trace_name} (page size {page_size})",
                 "eviction policy, write policy" if several else "eviction policy")


def write_fleet_plot(path: str, rows: list[dict], trace_name: str, page_size: int,
                     workers: int) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=PLOT_SIZE, dpi=PLOT_DPI)
    ax = fig.add_subplot()
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    lines = list(dict.fromkeys((r["router"], r["policy"], r.get("write_policy")) for r in rows))
    several = len({line[2] for line in lines}) > 1  # write policies of a host tier
    routed = [line for line in lines if line[0] != POOLED]
    pooled = [line for line in lines if line[0] == POOLED]
    colors = _palette(len(routed))
    for i, line in enumerate(routed + pooled):  # the pooled bound drawn last, on top
        router, policy, write_policy = line
        points = sorted((r["capacity"], r["hit_rate"]) for r in rows
                        if r["router"] == router and r["policy"] == policy
                        and r.get("write_policy") == write_policy)
        label = router if len(policies) == 1 else f"{router} ({policy})"
        if router == POOLED:
            label = f"pooled: one cache of {workers} x capacity" + (
                "" if len(policies) == 1 else f" ({policy})")
            p = pooled.index(line)
            style = dict(linestyle="--", **_series_style(i, len(lines),
                                                         _GREYS[p % len(_GREYS)]))
        else:
            r = routed.index(line)
            style = dict(linestyle="-", **_series_style(i, len(lines), colors[r % len(colors)]))
        if several:
            label += f", {write_policy}"
        ax.plot([c for c, _ in points], [100 * h for _, h in points], label=label, **style)
    title = "router" + (" (eviction policy)" if len(policies) > 1 else "")
    _finish_plot(path, fig, ax, rows, "KV pool capacity per worker (token slots)",
                 f"Hit rate over {workers} workers by router: {trace_name} (page {page_size})",
                 title + (", write policy" if several else ""))


def write_host_plot(path: str, rows: list[dict], trace_name: str, page_size: int,
                    workers: int = 1) -> None:
    """Hit rate against host capacity: one line per device capacity (and eviction policy,
    write policy and router when there are several); host 0 (no host tier) starts every line."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    fig = Figure(figsize=PLOT_SIZE, dpi=PLOT_DPI)
    ax = fig.add_subplot()
    varying = [key for key in ("policy", "write_policy", "router")
               if len({r.get(key) for r in rows if r["host_capacity"]}) > 1]
    lines = list(dict.fromkeys((r["capacity"], *(r.get(k) for k in varying))
                               for r in rows if r["host_capacity"]))
    others = list(dict.fromkeys(line[1:] for line in lines))
    routed = [line for line in lines if dict(zip(varying, line[1:])).get("router") != POOLED]
    pooled = [line for line in lines if line not in routed]
    colors = _palette(len(routed))
    for i, line in enumerate(lines):
        capacity, rest = line[0], dict(zip(varying, line[1:]))

        def on_line(r: dict, host_too: bool, capacity=capacity, rest=rest) -> bool:
            return r["capacity"] == capacity and all(
                r.get(k) == v for k, v in rest.items() if host_too or k != "write_policy")

        points = sorted((r["host_capacity"], r["hit_rate"]) for r in rows
                        if on_line(r, bool(r["host_capacity"])))
        label = ", ".join([short_count(capacity), *map(str, rest.values())])
        if line in routed:
            color = colors[routed.index(line) % len(colors)]
        else:  # the pooled bound of a fleet: greys, as in the fleet plot
            color = _GREYS[pooled.index(line) % len(_GREYS)]
        j = others.index(line[1:])
        ax.plot([h for h, _ in points], [100 * h for _, h in points], label=label,
                linestyle=_LINE_STYLES[j % len(_LINE_STYLES)],
                **_series_style(i, len(lines), color))
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
    fig.suptitle(f"Hit rate vs host memory{fleet}: {trace_name} (page {page_size})")
    ax.grid(True, alpha=0.3)
    _legend(ax, ", ".join([f"device capacity{per}", *(_COLUMN_NAMES[k] for k in varying)]))
    _save(fig, path)


def _save(fig: Any, path: str) -> None:
    """Lay the figure out and write it atomically, in the format ``path``'s extension names."""
    fig.tight_layout()
    file_format = plot_format(path)
    atomic_write(path, lambda temp_path: fig.savefig(temp_path, format=file_format,
                                                     dpi=PLOT_DPI))
