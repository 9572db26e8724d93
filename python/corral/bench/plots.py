"""PNG plots (matplotlib, headless): latency CDFs (latency, churn, snapshot), churn rates,
create rate vs live count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PHASE_COLORS = {"create": "#1f77b4", "first_exec": "#ff7f0e", "exec": "#d62728",
                "ttfr": "#2ca02c", "destroy": "#9467bd"}
COLORS = {"corral": "#1f77b4", "corral-disabled": "#17becf", "corral-batch": "#aec7e8",
          "raw": "#2ca02c", "raw-netns": "#98df8a", "raw-disabled": "#bcbd22", "bwrap": "#ff7f0e",
          "crun": "#9467bd", "runc": "#d62728"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, xs: list[float], label: str, **kw: Any) -> None:
    xs = sorted(x for x in xs if x > 0)
    if not xs:
        return
    n = len(xs)
    ax.step(xs, [(i + 1) / n for i in range(n)], where="post", label=f"{label} (n={n})", **kw)


def latency_cdf(samples: dict[str, list[float]], out: Path, title: str) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, xs in samples.items():
        system, _, phase = name.partition(" ")
        # "system phase" keys: colour = phase, line = system; plain keys: colour = system.
        color = PHASE_COLORS.get(phase) if phase else COLORS.get(system)
        _cdf(ax, xs, name, color=color, linestyle="--" if system.startswith("raw") else "-")
    ax.set_xscale("log")
    ax.set_xlabel("milliseconds (log)")
    ax.set_ylabel("fraction of operations")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def churn_rates(sec: dict[str, Any], out: Path) -> Path:
    """Sandboxes/s per system: bar = median over runs, whiskers = min..max."""
    plt = _plt()
    names = [k for k, v in sec["median"].items() if v.get("ops_per_s")]
    per_run = {k: [r[k]["ops_per_s"] for r in sec["runs"] if r.get(k, {}).get("ops_per_s")]
               for k in names}
    med = [sec["median"][k]["ops_per_s"] for k in names]
    lo = [m - min(per_run[k]) for m, k in zip(med, names, strict=True)]
    hi = [max(per_run[k]) - m for m, k in zip(med, names, strict=True)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(names, med, yerr=[lo, hi], capsize=4, color=[COLORS.get(k, "gray") for k in names])
    for i, m in enumerate(med):
        ax.text(i, m, f"{m:,.0f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("sandboxes / s")
    ax.set_title(f"churn: create -> exec true -> destroy ({sec['concurrency']} in flight)")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def density_rate(curves: dict[str, list[tuple[int, float]]], out: Path, n: int) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, pts in curves.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=name,
                    color=COLORS.get(name))
    ax.set_xlabel("sandboxes alive")
    ax.set_ylabel("creates / s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"create rate against the live count (filling to {n:,})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def network_scale(curve: list[dict[str, Any]], out: Path) -> Path:
    """Connect + echo p50 and bulk MB/s against the number of live networked sandboxes."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    live = [p["live"] for p in curve]
    for name in ("plain", "corral-internet", "corral-allowlist"):
        a1.plot(live, [p[name]["connect_rr_us"]["p50"] for p in curve], marker="o", label=name)
        a2.plot(live, [p[name]["bulk_mb_s"] for p in curve], marker="o", label=name)
    a1.set_ylabel("connect + 64-byte echo, p50 us")
    a2.set_ylabel("bulk TCP MB/s")
    for ax in (a1, a2):
        ax.set_xlabel("live networked sandboxes")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("network: the data path against the number of sandboxes in the table")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def make_all(report: dict[str, Any], samples: dict[str, Any], out_dir: Path) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    sc = report["scenarios"]
    if "latency" in samples:
        made.append(latency_cdf(samples["latency"], out_dir / "latency_cdf.png",
                                "latency, one client (corral via SDK vs raw syscalls)"))
    if "churn" in samples:
        made.append(latency_cdf(samples["churn"], out_dir / "churn_latency_cdf.png",
                                "churn: per-sandbox create+exec+destroy latency"))
        made.append(churn_rates(sc["churn"], out_dir / "churn_rates.png"))
    if "snapshot" in samples:
        made.append(latency_cdf(samples["snapshot"], out_dir / "snapshot_cdf.png",
                                f"snapshot ({sc['snapshot']['mb']} MB changed), restore, fork of "
                                f"{sc['snapshot']['fork_n']} (corral via SDK)"))
    if "density" in samples:
        made.append(density_rate(samples["density"]["curves"], out_dir / "density_rate.png",
                                 sc["density"]["n"]))
    if samples.get("network", {}).get("curve"):
        made.append(network_scale(samples["network"]["curve"], out_dir / "network_scale.png"))
    return [str(p) for p in made]
