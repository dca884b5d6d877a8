"""What a run writes down for people and for the record: markdown tables, saved figures, and paths without the machine's
prefix (a record names `outputs/cpu-1/...`, `../shared/data/...` or `~/.cache/...`, never `/home/me/lemon/...`).
No lemon imports: every stage may use it."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def md_table(df, floatfmt: str = "{:.3f}") -> str:
    """A pandas DataFrame as a markdown table (floats formatted with `floatfmt`)."""
    if df is None or df.empty:
        return "_(no rows yet)_"
    cell = lambda v: floatfmt.format(v) if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in df.itertuples(index=False)]
    return "\n".join(lines)


def save(fig, path: Path) -> Path:
    """Save a matplotlib figure as a PNG (parent folders made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _prefixes(root: Path | None = None, home: Path | None = None, tmp: Path | None = None) -> list[tuple[str, str]]:
    """(machine prefix, what a record writes instead), longest first: the repo root (default ROOT), the folder holding
    it (the shared data mirror sits beside the repo), the home folder (default: the user's), the temp folder (default:
    tempfile.gettempdir(); e.g. the managed servers' logs, gone after the run)."""
    root, home = ROOT if root is None else root, Path.home() if home is None else home
    tmp = Path(tempfile.gettempdir()) if tmp is None else tmp
    pairs = [(str(root), "."), (str(root.parent), ".."), (str(home), "~"), (str(tmp), "$TMPDIR")]
    # stable sort: on a tie (a checkout directly in the temp folder) the repo's own prefixes win
    return sorted(((p, s) for p, s in pairs if len(Path(p).parts) > 1), key=lambda ps: -len(ps[0]))


def portable_text(text: str, root: Path | None = None, home: Path | None = None, tmp: Path | None = None) -> str:
    """`text` with every absolute path under the repo root made relative to it (`/x/repo/outputs/a` -> `outputs/a`,
    the root itself -> `.`), under its parent folder written `../...`, under the home folder `~/...` and under the temp
    folder `$TMPDIR/...`."""
    for prefix, short in _prefixes(root, home, tmp):
        pat = re.compile(r"(?<![\w.~/-])" + re.escape(prefix) + r"(?=/|(?![\w.-]))(/?)")
        text = pat.sub(lambda m: "" if short == "." and m.group(1) else short + m.group(1), text)
    return text


def shown_path(path) -> str:
    """A path as a record writes it: portable_text of its absolute form, or just its name when it lies outside the
    repo, the folder holding it and the home folder."""
    path = Path(path).resolve()
    shown = portable_text(str(path))
    return path.name if shown == str(path) else shown


def portable(obj, root: Path | None = None, home: Path | None = None):
    """A JSON-able object with portable_text applied to every string in it, mapping keys included."""
    if isinstance(obj, str):
        return portable_text(obj, root, home)
    if isinstance(obj, dict):
        return {portable(k, root, home): portable(v, root, home) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [portable(v, root, home) for v in obj]
    return obj


def advantage_heatmaps(adv: dict, legend: bool = True):
    """Heat maps of one step's (B, T) advantages: the global part, the CF part and their total (keys "global", "cf",
    "total"), padding blank ("completion" = 0), the edited span S_i boxed in orange ("span"), forced tokens dotted
    ("forced"); one colour scale for all three. Both walk-throughs (lemon.testbed.walkthrough on simulated workers,
    lemon.study.walkthrough on the study's real ones) draw their step with it."""
    from matplotlib.figure import Figure  # lazy: matplotlib only for figures
    from matplotlib.patches import Rectangle
    fig = Figure(figsize=(12, 6), layout="constrained")
    vmax = max(float(adv["total"].abs().max()), float(adv["global"].abs().max()), 1e-6)
    titles = {"global": "global part: r_i - mean_group r on every free token", "cf": "CF part: lambda * delta_i on S_i",
              "total": "A_{i,t} = global + CF (what the loss weights)"}
    for ax, name in zip(fig.subplots(3, 1, sharex=True), titles):
        a = adv[name].numpy().copy()  # (B, T)
        a[adv["completion"].numpy() == 0] = float("nan")  # padding blank, not 0
        im = ax.imshow(a, aspect="auto", cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest")
        fb, ft = adv["forced"].nonzero(as_tuple=True)
        ax.scatter(ft, fb, s=2, c="#777777", marker=".", label="forced: A = 0")
        for b, t in zip(*adv["span"].nonzero(as_tuple=True)):
            ax.add_patch(Rectangle((int(t) - 0.5, int(b) - 0.5), 1, 1, fill=False, edgecolor="#E69F00", linewidth=1.2))
        ax.set(yticks=range(a.shape[0]), ylabel="rollout i")
        ax.set_title(titles[name], fontsize=10)
    ax.set_xlabel("completion token t")
    fig.colorbar(im, ax=fig.axes, shrink=0.6, label="advantage")
    if legend:
        fig.axes[0].legend(loc="upper right", fontsize=7, markerscale=4)
    return fig


def tokens_html(tok, ids, highlight=(), forced=(), title_html: str = "") -> str:
    """One sampled completion as HTML, one box per token (its position t on hover): `highlight` positions (the edited
    span S_i) orange and bold, `forced` positions grey; `title_html` (already HTML) opens the caption. Both
    walk-throughs show their edited tokens with it."""
    import html  # lazy: only the walk-throughs draw tokens
    hl, fc, cells = set(highlight), set(forced), []
    for t, tid in enumerate(ids):
        s = html.escape(tok.decode([tid])).replace("\n", "⏎<br>").replace(" ", "&nbsp;")
        style = "background:#E69F00;font-weight:bold" if t in hl else "color:#aaaaaa" if t in fc else ""
        cells.append(f'<span title="t={t}" style="{style};border-right:1px solid #eeeeee">{s}</span>')
    return (f"<p>{title_html} {len(ids)} tokens, {len(fc)} forced (grey), S_i = {sorted(hl)} (orange)</p>"
            '<div style="font-family:monospace;font-size:12px;line-height:1.7">' + "".join(cells) + "</div>")
