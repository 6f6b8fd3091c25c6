"""The sweep's PNGs (matplotlib, no display needed): throughput, scaling efficiency and the time breakdown
against ranks, measured next to predicted where the performance model gave a prediction.

For each rank count the plots use the run with the most tokens/s (the best layout measured there).
"""
from __future__ import annotations

import os


def best_per_ranks(rows: list[dict]) -> list[dict]:
    best: dict[int, dict] = {}
    for r in rows:
        if r.get("status") == "ok" and (r["ranks"] not in best or r["tokens_per_s"] > best[r["ranks"]]["tokens_per_s"]):
            best[r["ranks"]] = r
    return [best[k] for k in sorted(best)]


def _layout(r: dict) -> str:
    return f"dp{r['dp']} tp{r['tp']} pp{r['pp']}"


def write_plots(rows: list[dict], out_dir: str, title: str) -> list[str]:
    """throughput.png, efficiency.png, breakdown.png in ``out_dir``; returns their paths ([] if no run ok)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_per_ranks(rows)
    if not best:
        return []
    ranks = [r["ranks"] for r in best]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ranks, [r["tokens_per_s"] for r in best], "o-", label="measured (best layout)")
    predicted = [r.get("predicted_tokens_per_s") for r in best]
    if any(p is not None for p in predicted):
        ax.plot(ranks, [float("nan") if p is None else p for p in predicted], "s--", label="predicted (hpctrain plan model)")
    ideal = [best[0]["tokens_per_s"] * k / ranks[0] for k in ranks]
    ax.plot(ranks, ideal, ":", color="gray", label="linear")
    for r in best:
        ax.annotate(_layout(r), (r["ranks"], r["tokens_per_s"]), fontsize=7, textcoords="offset points",
                    xytext=(4, -10))
    ax.set(xlabel="ranks", ylabel="tokens / s", title=f"throughput: {title}", xscale="log", xticks=ranks)
    ax.set_xticklabels([str(k) for k in ranks])
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir, "throughput.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ranks, [r.get("efficiency", 0.0) for r in best], "o-", label="measured")
    if any(p is not None for p in predicted):
        base = predicted[0] or 1.0
        ax.plot(ranks, [(p or 0.0) / base / (k / ranks[0]) for p, k in zip(predicted, ranks)], "s--",
                label="predicted")
    ax.axhline(1.0, color="gray", linestyle=":")
    ax.set(xlabel="ranks", ylabel="scaling efficiency", title=f"efficiency: {title}", ylim=(0, 1.2),
           xscale="log", xticks=ranks)
    ax.set_xticklabels([str(k) for k in ranks])
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir, "efficiency.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    width, x = 0.38, list(range(len(best)))
    bottoms = [0.0] * len(best)
    for key, label, color in (("compute_s", "compute", "tab:blue"), ("comm_s", "exposed comm", "tab:orange"),
                              ("bubble_s", "bubble", "tab:red")):
        values = [1e3 * r[key] for r in best]
        ax.bar([i - width / 2 for i in x], values, width, bottom=bottoms, label=f"{label} (measured)", color=color)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    if any(r.get("predicted_compute_s") is not None for r in best):
        bottoms = [0.0] * len(best)
        for key, color in (("predicted_compute_s", "tab:blue"), ("predicted_comm_s", "tab:orange"),
                           ("predicted_bubble_s", "tab:red")):
            values = [1e3 * (r.get(key) or 0.0) for r in best]
            ax.bar([i + width / 2 for i in x], values, width, bottom=bottoms, color=color, alpha=0.45,
                   hatch="//")
            bottoms = [b + v for b, v in zip(bottoms, values)]
        ax.bar([0], [0], color="white", hatch="//", edgecolor="gray", label="predicted (hatched)")
    ax.set_xticks(x, [f"{r['ranks']}\n{_layout(r)}" for r in best], fontsize=7)
    ax.set(ylabel="ms per step", title=f"where the step goes: {title}")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir, "breakdown.png"))
    return paths


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
