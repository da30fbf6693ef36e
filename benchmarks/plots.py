"""PNG plots of measured results: bytes vs Zipf alpha, bytes vs hot rows (matplotlib, Agg).

Readable by construction: at most `MAX_SERIES` lines a panel, each sharding type with its own
colour *and* line style *and* marker (so lines that coincide, e.g. the stock planner's and
table_wise's, stay distinguishable, also in grey-scale), log axes labelled as such.
"""

from typing import Dict, List, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MB = 1e6
MAX_SERIES = 10  # 8 plans (6 stock or hand-written, the hybrid planner's 2) + 2 cost-model lines
# (colour, line style, marker) per sharding type; the stock planner's plan is often table_wise
# itself, so its line is dashed with hollow markers over table_wise's solid one
STYLE = {
    "frequency_hybrid": ("tab:red", "-", "o"),
    "table_wise": ("tab:blue", "-", "s"),
    "planner": ("tab:cyan", "--", "D"),
    "column_wise": ("tab:green", "-.", "^"),
    "row_wise": ("tab:purple", (0, (5, 1, 1, 1)), "v"),
    "data_parallel": ("tab:brown", (0, (3, 1, 1, 1, 1, 1)), "P"),  # dotted alone means cost model
    "hybrid_planner": ("tab:orange", "--", "X"),  # the hybrid planner's plans (benchmarks/models.py)
    "hybrid_planner_bytes": ("tab:pink", "--", "*"),
}
MODEL_KINDS = ("frequency_hybrid", "table_wise")  # whose cost-model estimate is drawn (dotted, x)


def _style(kind: str):
    color, ls, marker = STYLE.get(kind, ("black", "-", "."))
    hollow = kind == "planner"
    return dict(color=color, linestyle=ls, marker=marker, markersize=6 if hollow else 5,
                markerfacecolor="none" if hollow else color, lw=1.5)


def _alpha_x(a: float, alphas: List[float]) -> float:
    """Where id law ``a`` sits on a panel of ``alphas``: uniform ids (0) just left of the panel's Zipf points."""
    zipf = [x for x in alphas if x > 0]
    return a if a > 0 else (min(zipf) - 0.05 if zipf else 1.0)


def bytes_vs_alpha(results: List[Dict], path: str) -> Optional[str]:
    """One panel per (W, model, hotness) with >= 2 id laws: measured (solid) and model (dotted)."""
    groups: Dict[tuple, List[Dict]] = {}
    for r in results:
        w = r["workload"]
        if len(w["types"]) > 1:
            # one configuration but the id law per panel (a headline and a sweep of other B, H or dim apart)
            key = (w["world"], w["device"], w["model"], w["multi_hot"], w["rows_cap"], w["batch_per_rank"],
                   w["hot_rows"], w["dim"])
            groups.setdefault(key, []).append(r)
    groups = {k: sorted(v, key=lambda r: r["workload"]["alpha"]) for k, v in groups.items() if len(v) >= 2}
    if not groups:
        return None
    cols = min(4, len(groups))
    rows = (len(groups) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, (key, rs) in zip(axes.flat, groups.items()):
        xs = [_alpha_x(r["workload"]["alpha"], [q["workload"]["alpha"] for q in rs]) for r in rs]
        kinds = list(rs[0]["results"])
        models = [k for k in MODEL_KINDS if k in kinds]
        assert len(kinds) + len(models) <= MAX_SERIES, kinds
        for kind in kinds:
            ys = [r["results"][kind]["bytes_per_rank_per_step"] / MB for r in rs]
            ax.plot(xs, ys, label=kind, **_style(kind))
        for kind in models:
            ax.plot(xs, [r["results"][kind]["expected_bytes_per_rank_per_step"] / MB for r in rs],
                    linestyle=":", marker="x", lw=1, color=STYLE[kind][0], label=f"{kind} (cost model)")
        ax.set_xticks(xs, ["uniform" if r["workload"]["alpha"] == 0 else f"{r['workload']['alpha']:g}" for r in rs])
        ax.set_yscale("log")
        ax.set_xlabel("id distribution (Zipf alpha)")
        ax.set_ylabel("MB sent per rank per step (log scale)")
        W, dev, model, multi, cap, batch, hot, dim = key
        ax.set_title(f"measured: W={W} {dev}, {model}, {'multi-hot' if multi else 'one-hot'}, cap {cap:,}, "
                     f"B={batch}, H={hot}, dim {dim}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    # one legend for all panels, below them, so it covers no data
    handles, labels = axes[0][0].get_legend_handles_labels()
    ncol = 4 if cols > 1 else 2
    bottom = (0.3 + 0.17 * -(-len(labels) // ncol)) / fig.get_figheight()  # inches for the legend rows
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=7, frameon=False,
               title="measured; dotted with x: cost model", title_fontsize=7)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bytes_vs_hot_rows(sweep: List[Dict], reference: Optional[Dict], path: str) -> Optional[str]:
    """The hybrid at several hot-set sizes; stock table_wise of the same workload as a line."""
    if len(sweep) < 2:
        return None
    sweep = sorted(sweep, key=lambda r: r["hot_set"]["hot_rows_total"])
    xs = [max(r["hot_set"]["hot_rows_total"], 1) for r in sweep]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    hy = [r["results"]["frequency_hybrid"] for r in sweep]
    ax.plot(xs, [h["bytes_per_rank_per_step"] / MB for h in hy], label="frequency_hybrid measured",
            **_style("frequency_hybrid"))
    ax.plot(xs, [h["expected_bytes_per_rank_per_step"] / MB for h in hy], linestyle=":", marker="x", lw=1,
            color=STYLE["frequency_hybrid"][0], label="frequency_hybrid (cost model)")
    if reference is not None:
        for kind in ("table_wise", "row_wise"):
            if kind in reference["results"]:
                color, ls, _ = STYLE[kind]
                ax.axhline(reference["results"][kind]["bytes_per_rank_per_step"] / MB, linestyle=ls,
                           color=color, lw=1.2, label=f"{kind} measured (hot rows do not apply)")
    w = sweep[0]["workload"]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("hot rows, total over all tables (log scale; 0 drawn at 1)")
    ax.set_ylabel("MB sent per rank per step (log scale)")
    ax.set_title(f"measured: W={w['world']}, {w['model']}, {'multi-hot' if w['multi_hot'] else 'one-hot'}, "
                 f"{'uniform' if w['alpha'] == 0 else 'Zipf ' + format(w['alpha'], 'g')}, cap {w['rows_cap']:,}, "
                 f"B={w['batch_per_rank']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
