"""PNG plots of measured results: bytes vs Zipf alpha, bytes vs hot rows (matplotlib, Agg)."""

from typing import Dict, List, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MB = 1e6


def _alpha_x(a: float) -> float:
    return a if a > 0 else 1.0  # uniform ids are drawn left of the Zipf points


def bytes_vs_alpha(results: List[Dict], path: str) -> Optional[str]:
    """One panel per (W, model, hotness) with >= 2 id laws: measured (solid) and model (dotted)."""
    groups: Dict[tuple, List[Dict]] = {}
    for r in results:
        w = r["workload"]
        if len(w["types"]) > 1:
            groups.setdefault((w["world"], w["device"], w["model"], w["multi_hot"], w["rows_cap"]), []).append(r)
    groups = {k: sorted(v, key=lambda r: r["workload"]["alpha"]) for k, v in groups.items() if len(v) >= 2}
    if not groups:
        return None
    cols = min(4, len(groups))
    rows = (len(groups) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, (key, rs) in zip(axes.flat, groups.items()):
        xs = [_alpha_x(r["workload"]["alpha"]) for r in rs]
        for kind in rs[0]["results"]:
            ys = [r["results"][kind]["bytes_per_rank_per_step"] / MB for r in rs]
            line, = ax.plot(xs, ys, marker="o", label=kind)
            ax.plot(xs, [r["results"][kind]["expected_bytes_per_rank_per_step"] / MB for r in rs],
                    linestyle=":", color=line.get_color())
        ax.set_xticks(xs, ["uniform" if r["workload"]["alpha"] == 0 else f"{r['workload']['alpha']:g}" for r in rs])
        ax.set_yscale("log")
        ax.set_xlabel("id distribution (Zipf alpha)")
        ax.set_ylabel("MB sent per rank per step")
        W, dev, model, multi, cap = key
        ax.set_title(f"measured: W={W} {dev}, {model}, {'multi-hot' if multi else 'one-hot'}, cap {cap:,}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, title="solid: measured, dotted: model", title_fontsize=7)
    fig.tight_layout()
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
    ax.plot(xs, [h["bytes_per_rank_per_step"] / MB for h in hy], marker="o", label="frequency_hybrid measured")
    ax.plot(xs, [h["expected_bytes_per_rank_per_step"] / MB for h in hy], linestyle=":", marker="x",
            label="frequency_hybrid model")
    if reference is not None:
        for kind in ("table_wise", "row_wise"):
            if kind in reference["results"]:
                ax.axhline(reference["results"][kind]["bytes_per_rank_per_step"] / MB, linestyle="--",
                           color="gray" if kind == "table_wise" else "silver", label=f"{kind} measured")
    w = sweep[0]["workload"]
    ax.set_xscale("log")
    ax.set_xlabel("hot rows, total over all tables (0 drawn at 1)")
    ax.set_ylabel("MB sent per rank per step")
    ax.set_title(f"measured: W={w['world']}, {w['model']}, {'multi-hot' if w['multi_hot'] else 'one-hot'}, "
                 f"{'uniform' if w['alpha'] == 0 else 'Zipf ' + format(w['alpha'], 'g')}, cap {w['rows_cap']:,}, "
                 f"B={w['batch_per_rank']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
