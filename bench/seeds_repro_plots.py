"""The plots of ``bench/seeds_repro.py`` (written next to its ``results.md``), from the cell JSONs.

* ``gain_vs_N.png``: grid B, held-out gain against N per loss (bars: the after-eval's se; every
  cell's greedy before is the same), with each loss's on-policy point and TIS-off point at N = 16.
* ``gain_vs_wall.png``: gain against loop wall time at every eval of a run (a cell's ``curve``:
  intermediate evals with ``eval.interval``, else its before and after), grid A sync vs async,
  grids L and L48 (lag-matched sync vs async) and each grid-C loss by N: the papers' "same quality in less time" (Noukhovitch et al. 2024,
  Fig. 1) as curves, not end points.
* ``frontier.png``: gain against KL(policy || reference) per token on the eval's fresh samples
  (``eval/math/kl_ref``), one line per N through a run's evals (grid L's sync and async Online DPO
  in the online_dpo panel), one panel per loss: the
  reward-KL frontier of Noukhovitch et al. 2024 (Fig. 3-4). Cells without ``kl_ref`` (those run
  before it existed) are left out.

Each function takes the results (cell name -> JSON) and the grid's cells (``seeds_repro.Cell``:
``name``, ``group``, ``loss``, ``n``, ``sync``, ``seed``, ``alias``, ``papers_n``, ``extra``) and
writes one PNG.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["gain_vs_n", "gain_vs_wall", "frontier", "curve_points", "save"]

_COLORS = {1: "tab:blue", 2: "tab:green", 4: "tab:orange", 16: "tab:red"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, ax, title: str, path: Path, suptitle: str | None = None) -> None:
    """Title, legend (when anything is labelled), tight layout; write ``path`` (PNG) and close."""
    plt = _plt()
    ax.set_title(title, fontsize=9)
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _res(results: dict, c):
    return results.get(c.alias or c.name)


def _tis_off(c) -> bool:
    return "algorithm.is_correction=none" in c.extra


def curve_points(r: dict, x: str) -> list[tuple[float, float]]:
    """``(x, gain)`` at every eval of cell JSON ``r``: ``x`` = ``wall_s`` (minutes) or ``kl_ref``
    (points without it dropped); a cell without a ``curve`` gives ``(loop wall, gain)`` for
    ``wall_s`` and nothing for ``kl_ref``."""
    curve = r.get("curve") or []
    if not curve:
        return [(r["loop_wall_s"] / 60, r["gain"])] if x == "wall_s" else []
    if x == "wall_s":
        return [(c["wall_s"] / 60, c["gain"]) for c in curve]
    return [(c["kl_ref"], c["gain"]) for c in curve if c.get("kl_ref") is not None]


_LAG_COLORS = {True: "tab:gray", False: "tab:purple"}   # grids L / L48: sync, async (not an N)


def _label(c) -> str:
    if c.group in ("L", "L48"):
        return f"{c.group} {'sync' if c.sync else 'async'}" + (f" (lr {c.lr:g})" if c.lr else "")
    if c.sync:
        return "N=1 (on-policy)"
    return f"N={c.n}" + ("" if c.papers_n else " (+1 lag)") + (", TIS off" if _tis_off(c) else "")


def gain_vs_n(path: Path, results: dict, cells: list, n_values=(1, 4, 16)) -> None:
    """``gain_vs_N.png`` (module docstring)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    b = [c for c in cells if c.group == "B"]
    for i, loss in enumerate(dict.fromkeys(c.loss for c in b)):
        pts = [(c.n * (1 + 0.04 * (i - 1)), r["gain"], r["after_se"]) for c in b
               if c.loss == loss and not c.sync and not _tis_off(c) and (r := _res(results, c))]
        line = None
        if pts:
            line = ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                               capsize=3, label=loss)
        color = line[0].get_color() if line else None
        for c in b:
            r = _res(results, c) if c.loss == loss and (c.sync or _tis_off(c)) else None
            if r:   # the on-policy point left of N = 1, TIS off beside N = 16
                x = (0.5 if c.sync else c.n * 1.15) * (1 + 0.04 * (i - 1))
                ax.errorbar([x], [r["gain"]], yerr=[r["after_se"]], marker="*" if c.sync else "x", ls="none",
                            capsize=3, color=color, label=f"{loss} {_label(c)}")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks([0.5, *n_values], ["on-policy", *[str(n) for n in n_values]])
    ax.set_xlabel("N = async.sync_interval = max_staleness (16 = never synced)")
    ax.set_ylabel("held-out gain (after - before), ± se of the after")
    ax.text(0.01, 0.01, "bars: se of the after-eval (the before is the same in every cell)", fontsize=7,
            transform=ax.transAxes, color="grey")
    save(fig, ax, "Held-out gain vs off-policyness N (seed 0)", path)


def _panels(n: int, plt):
    fig, axes = plt.subplots(1, max(n, 1), figsize=(4.6 * max(n, 1), 4.0), squeeze=False)
    return fig, list(axes[0])


def _sync_async_panel(ax, results: dict, cells: list, group: str) -> None:
    """Grid A, L or L48: every seed's sync and async curve of gain against loop wall time."""
    for mode, marker in (("sync", "s"), ("async", "o")):
        first = True
        for c in cells:
            r = _res(results, c) if c.group == group and c.sync == (mode == "sync") else None
            if r:
                pts = curve_points(r, "wall_s")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, ms=4,
                        color="tab:blue" if mode == "sync" else "tab:orange",
                        label=f"{mode} Online DPO" if first else None, alpha=0.8)
                ax.annotate(f"s{c.seed}", pts[-1], textcoords="offset points", xytext=(5, 4), fontsize=7)
                first = False
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("loop wall time (min; load average in results.md)")
    ax.set_ylabel("held-out gain at each eval (shared before)")
    ax.set_title({"A": "A: sync vs one-step async (16 steps each)",
                  "L": "L: sync 16 vs async 17 steps (lag-matched)",
                  "L48": "L48: sync 48 vs async 49 steps"}.get(group, group), fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def gain_vs_wall(path: Path, results: dict, cells: list) -> None:
    """``gain_vs_wall.png`` (module docstring): grid A, then grids L and L48 where they have data,
    then one panel per grid-C loss with data."""
    plt = _plt()
    c_losses = [loss for loss in dict.fromkeys(c.loss for c in cells if c.group in ("C", "Cseeds"))
                if any(_res(results, c) for c in cells if c.group in ("C", "Cseeds") and c.loss == loss)]
    lag = [g for g in ("L", "L48") if any(_res(results, c) for c in cells if c.group == g)]
    fig, axes = _panels(1 + len(lag) + len(c_losses), plt)
    for ax, group in zip(axes, ["A"] + lag):
        _sync_async_panel(ax, results, cells, group)
    for ax, loss in zip(axes[1 + len(lag):], c_losses):
        _lines(ax, results, [c for c in cells if c.group in ("C", "Cseeds") and c.loss == loss], "wall_s")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlabel("loop wall time (min)")
        ax.set_title(f"C: {loss}", fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("Held-out gain vs wall time", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _lines(ax, results: dict, cells: list, x: str) -> int:
    """One line per cell through its evals, coloured by N (seed 0 solid and labelled, other seeds
    faint); returns how many cells had points."""
    drawn, labelled = 0, set()
    for c in cells:
        r = _res(results, c)
        pts = curve_points(r, x) if r else []
        if not pts:
            continue
        label = _label(c) if (_label(c), c.group) not in labelled and c.seed == 0 else None
        labelled.add((_label(c), c.group))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                ls="-" if (c.papers_n or c.sync) else "--",
                color=(_LAG_COLORS[bool(c.sync)] if c.group in ("L", "L48") else _COLORS.get(c.n, "tab:gray")),
                alpha=1.0 if c.seed == 0 else 0.4, label=label)
        drawn += 1
    return drawn


def frontier(path: Path, results: dict, cells: list) -> None:
    """``frontier.png`` (module docstring): one panel per loss with ``kl_ref`` data (grids B and C;
    solid: the papers' N, dashed: grid B's N with one step of lag), a placeholder when none has."""
    plt = _plt()
    pool = [c for c in cells if c.group in ("B", "C", "Cseeds", "L", "L48")]
    losses = [loss for loss in dict.fromkeys(c.loss for c in pool)
              if any(curve_points(r, "kl_ref") for c in pool if c.loss == loss and (r := _res(results, c)))]
    fig, axes = _panels(len(losses), plt)
    for ax, loss in zip(axes, losses):
        _lines(ax, results, [c for c in pool if c.loss == loss], "kl_ref")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlabel("KL(policy || reference), nats/token, fresh samples (k3)")
        ax.set_title(loss, fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[0].set_ylabel("held-out gain at each eval")
    if not losses:
        axes[0].text(0.5, 0.5, "no cell with eval/math/kl_ref yet", ha="center", va="center",
                     transform=axes[0].transAxes)
    save(fig, axes[0], axes[0].get_title(), path,
         suptitle="Held-out gain vs KL to the reference on fresh samples (frontier; one line per N)")
