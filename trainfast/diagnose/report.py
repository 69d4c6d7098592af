"""The doctor's report as text (verdict first, then the evidence) and as a self-contained
HTML page with a step-time breakdown chart and a per-layer cost chart (inline SVG).
"""

from __future__ import annotations

import html
import io
import textwrap

from trainfast import units
from trainfast.diagnose.timing import STAGES
from trainfast.diagnose.verdict import cores_sentence

_STAGE_NAMES = {"data": "data wait", "copy": "host→device", "forward": "forward", "backward": "backward",
                "optimizer": "optimizer", "other": "other"}


def _si(x: float, unit: str) -> str:
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _shape(s) -> str:
    return "×".join(str(v) for v in s)


def render_text(r) -> str:
    t, roof, cost = r.times, r.roofline, r.cost
    lines = [f"trainfast doctor — {r.model} on {r.data}",
             f"{r.speed.label()}, device {r.system['device']}, {t.steps} timed steps", ""]
    lines.append(f"VERDICT  {r.verdict.sentence}")
    if r.load_warning:
        lines.append(f"WARNING  {r.load_warning}")
    compute_rate = t.images_per_s * t.step / max(t.step - t.data, 1e-12)  # the same rate without the data wait
    how = " (steps back to back; the stage times below synchronise every step)" if t.steady else ""
    lines.append(f"         {units.rate(t.images_per_s)} images/s now{how}; the compute side alone runs at "
                 f"{units.rate(compute_rate)} images/s")
    lines.append(f"         roofline {units.ms(roof.bound_s)} ms/image vs {units.ms(roof.measured_s)} ms measured "
                 f"({roof.share_of_peak:.1%} of the {roof.dtype} peak)")
    if roof.share_of_ceiling is not None:
        lines.append(f"         kernels' ceiling {units.ms(roof.ceiling_s)} ms/image (each convolution and matmul alone, "
                     f"in its fastest layout): the step runs at {roof.share_of_ceiling:.0%} of it, the kernels at "
                     f"{roof.kernels_share_of_peak:.0%} of the peak")
    if r.storage:
        lines.append(f"STORAGE  {r.storage['sentence']}")
    lines += ["", "Where the time goes (median per step)"]
    for s in STAGES:
        v, share = getattr(t, s), t.share(s)
        lines.append(f"  {_STAGE_NAMES[s]:12s} {'█' * round(share * 40):40s} {units.ms(v):>9s} ms {share:5.0%}")
    lines.append(f"  {'step':12s} {'':40s} {units.ms(t.step):>9s} ms")
    if r.recommendations or r.fixes_note:
        lines += ["", "What to do, ranked by expected gain"]
        if r.fixes_note:
            lines.append(f"  {r.fixes_note}")
        lines += recommendation_lines(r.recommendations)
    s = r.system
    p = r.peaks
    lines += ["", "System"]
    gpus = ", ".join(f"{g['name']} (sm{g['compute_capability']}, {g['memory_gb']} GB)" for g in s["gpus"]) or "none usable"
    lines.append(f"  device in use {s['device']}; GPUs: {gpus}; torch {s['torch']}")
    lines.append(f"  CPU {s['cpu']}: {s['physical_cores']} physical cores, torch uses {s['torch_threads']} threads; "
                 f"ISA {' '.join(s['isa']) or '—'}")
    lines += [f"  {part}" for part in textwrap.wrap(f"Cores: {cores_sentence(r)}", 100)]
    peak_txt = ", ".join(f"{_si(v, 'FLOP/s')} {k}" for k, v in p["matmul_flops"].items())
    if "bfloat16" not in p["matmul_flops"]:
        peak_txt += " (bf16 is emulated here, slower than fp32: " + (
            "no AVX512-BF16 or AMX-BF16 instructions)" if s["device"].startswith("cpu") else "it needs sm80 or newer)")
    lines.append(f"  measured peaks: matmul {peak_txt}; copy {_si(p['copy_bytes'], 'B/s')}"
                 f"{' (cached; --remeasure to refresh)' if p.get('cached') else ''}")
    lines += ["", f"Model: {cost.params:,} parameters; per image {_si(cost.forward_flops, 'FLOP')} forward, "
                  f"{_si(cost.train_flops, 'FLOP')} per training step (FLOPs, not MACs); "
                  f"{_si(cost.activation_bytes, 'B')} of activations"]
    lines.append(f"  {'layer':22s} {'kind':14s} {'output':>14s} {'params':>11s} {'':>4s} {'FLOPs':>10s} {'':>4s}")
    for l in cost.layers:
        if not (l.params or l.flops):
            continue
        ps = l.params / max(cost.params, 1)
        fs = l.flops / max(cost.forward_flops, 1)
        lines.append(f"  {l.name[:22]:22s} {l.kind[:14]:14s} {_shape(l.output_shape):>14s} {l.params:>11,} {ps:4.0%} "
                     f"{_si(l.flops, ''):>10s} {fs:4.0%}")
    lines += ceiling_lines(r.ceiling)
    if cost.findings:
        lines += ["", "Findings about the model"]
        lines += [f"  - {f}" for f in cost.findings]
    lines += ["", f"({r.seconds:.0f} s)"]
    return "\n".join(lines)


def ceiling_lines(c, top: int = 8) -> list[str]:
    """The kernels' ceiling layer by layer: the slowest configurations first."""
    if c is None or not c.kernels:
        return []
    total = c.step_s
    lines = ["", f"Kernels alone: each convolution and matmul, forward + backward at batch {c.batch_size}, "
                 f"{c.precision}, in its fastest layout ({units.ms(total)} ms a step in all; measured in "
                 f"{c.seconds_to_time:.0f} s)"]
    ranked = sorted(c.kernels, key=lambda k: -k.total_s)
    for k in ranked[:top]:
        names = k.layers[0] + (f" (+{len(k.layers) - 1} alike)" if len(k.layers) > 1 else "")
        lines.append(f"  {names[:34]:34s} {k.kind[:8]:8s} {_shape(k.input_shape):>14s} in  "
                     f"{units.ms(k.total_s):>9s} ms {k.total_s / total:4.0%}  {k.layout}")
    if len(ranked) > top:
        rest = sum(k.total_s for k in ranked[top:])
        lines.append(f"  {f'{len(ranked) - top} more':34s} {'':8s} {'':>14s}     {units.ms(rest):>9s} ms {rest / total:4.0%}")
    return lines


def _gain(rec) -> str:
    if not rec.speedup:
        return ""
    spread = f", ×{rec.spread[0]:.2f}–×{rec.spread[1]:.2f}" if rec.spread else ""
    return f"×{rec.speedup:.2f} {'measured' if rec.measured else 'estimate'}{spread}"


def recommendation_lines(recs) -> list[str]:
    """The ranked fixes as text: title and gain, the evidence, then the command or code to paste."""
    lines = []
    for i, rec in enumerate(recs, 1):
        lines.append(f"  {i}. {rec.title}  [{_gain(rec) or '—'}]")
        if rec.evidence:
            lines.append(f"     {rec.evidence}")
        lines += [f"       {a}" for a in rec.action.splitlines()]
    return lines


def recommendations_html(recs) -> str:
    e = html.escape
    return "<ol>" + "".join(
        f'<li><span class="gain">{e(_gain(rec))}</span> <b>{e(rec.title)}</b>'
        + (f'<div class="evidence">{e(rec.evidence)}</div>' if rec.evidence else "")
        + f'<code class="block">{e(rec.action)}</code></li>' for rec in recs) + "</ol>"


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]


def stages_chart(parts: list[tuple[str, float]]) -> str:
    """One stacked bar of (stage, ms per step), as inline SVG."""
    from matplotlib.figure import Figure  # NOTE: not pyplot: a notebook's backend stays the user's

    fig = Figure(figsize=(8, 1.8))
    ax = fig.subplots()
    left = 0.0
    colours = ["#d62728", "#9467bd", "#1f77b4", "#2ca02c", "#ff7f0e", "#7f7f7f"]
    for (name, ms), c in zip(parts, colours):
        ax.barh([0], [ms], left=left, color=c, label=f"{name} {ms:.3g} ms")
        left += ms
    ax.set_yticks([])
    ax.set_xlabel("ms per step")
    ax.legend(ncol=3, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.45), frameon=False)
    ax.set_title("Where each training step's time goes")
    svg = _svg(fig)
    return svg


def step_chart(r) -> str:
    return stages_chart([(_STAGE_NAMES[s], getattr(r.times, s) * 1e3) for s in STAGES])


def layer_chart(r) -> str:
    return layers_chart([(l.name, l.kind, l.flops, l.params) for l in r.cost.layers if l.params or l.flops])


def layers_chart(layers: list[tuple[str, str, float, int]]) -> str:
    """Per-layer forward FLOPs and parameters, (name, kind, flops, params) each, as inline SVG."""
    from matplotlib.figure import Figure

    names = [f"{name} ({kind})".replace("$", r"\$") for name, kind, _, _ in layers]  # NOTE: '$…$' would be mathtext
    fig = Figure(figsize=(10, 0.3 * len(layers) + 1.2))
    axes = fig.subplots(1, 2, sharey=True)
    axes[0].barh(names, [f / 1e6 for _, _, f, _ in layers], color="#1f77b4")
    axes[0].set_xlabel("forward MFLOPs per image")
    axes[1].barh(names, [p / 1e3 for _, _, _, p in layers], color="#ff7f0e")
    axes[1].set_xlabel("parameters (thousands)")
    axes[0].invert_yaxis()
    fig.suptitle("Per-layer cost: FLOPs hold the time, parameters the memory")
    svg = _svg(fig)
    return svg


REPORT_CSS = """
.tf-report{font-family:system-ui,sans-serif;max-width:1000px;line-height:1.45;overflow-wrap:anywhere}
.tf-report h1{font-size:1.35em;margin:.2em 0}.tf-report h2{font-size:1.1em;margin:1.2em 0 .4em}
.tf-report .verdict{font-size:1.15em;padding:.6em .8em;background:#fff3cd;border-left:4px solid #e0a800;margin:.6em 0}
.tf-report .warning{padding:.5em .8em;background:#fde2e1;border-left:4px solid #c0392b;margin:.6em 0}
.tf-report .gain{display:inline-block;min-width:6.5em;font-weight:600;color:#1a7f37}
.tf-report ol li{margin:.5em 0}.tf-report .evidence{color:#555}
.tf-report pre,.tf-report code.block{display:block;white-space:pre-wrap;background:#f6f6f6;padding:.5em .7em;
 font-size:13px;margin:.3em 0}
.tf-report svg{max-width:100%;height:auto}
.tf-report details pre{white-space:pre-wrap}
"""


def advice_html(r) -> str:
    """The verdict, warnings, 'What to do' and the findings as HTML text: what a reader acts on."""
    e = html.escape
    t = r.times
    compute_rate = t.images_per_s * t.step / max(t.step - t.data, 1e-12)
    parts = [f'<p class="verdict">{e(r.verdict.sentence)}</p>']
    if r.load_warning:
        parts.append(f'<p class="warning"><b>Busy machine:</b> {e(r.load_warning)}</p>')
    parts.append(f"<p>{e(units.rate(t.images_per_s))} images/s now; the compute side alone runs at "
                 f"{e(units.rate(compute_rate))} images/s ({e(r.speed.label())}, "
                 f"{e(r.system['device'])}).</p>")
    if r.roofline.share_of_ceiling is not None:
        parts.append(f"<p><b>Kernels' ceiling:</b> {e(r.roofline.ceiling_sentence())}.</p>")
    if r.storage:
        parts.append(f"<p><b>Storage:</b> {e(r.storage['sentence'])}</p>")
    parts.append("<h2>What to do</h2>")
    if r.fixes_note:
        parts.append(f"<p>{e(r.fixes_note)}.</p>")
    if r.recommendations:
        parts.append(recommendations_html(r.recommendations))
    elif not r.fixes_note:
        parts.append("<p>No fixes were tried (try_fixes=False).</p>")
    parts.append(f"<h2>Cores</h2><p>{e(cores_sentence(r))}</p>")
    if r.cost.findings:
        parts.append("<h2>Findings about the model</h2><ul>"
                     + "".join(f"<li>{e(f)}</li>" for f in r.cost.findings) + "</ul>")
    return "".join(parts)


def render_fragment(r, charts: bool = True) -> str:
    """The report as one self-styled <div>: a notebook's cell output, and the body of the HTML file."""
    e = html.escape
    body = [f'<div class="tf-report"><style>{REPORT_CSS}</style>',
            f"<h1>trainfast doctor — {e(r.model)} on {e(r.data)}</h1>", advice_html(r)]
    if charts:
        body.append(f'<h2>Step-time breakdown</h2><div id="step-breakdown">{step_chart(r)}</div>'
                    f'<h2>Per-layer cost</h2><div id="layer-cost">{layer_chart(r)}</div>')
    body.append(f"<details><summary>Full report (text)</summary><pre>{e(render_text(r))}</pre></details></div>")
    return "".join(body)


def page(title: str, body: str) -> str:
    """A self-contained HTML page in the reports' style (a body already rendered as a .tf-report div
    is used as is)."""
    if not body.startswith('<div class="tf-report">'):
        body = f'<div class="tf-report"><style>{REPORT_CSS}</style><h1>{html.escape(title)}</h1>{body}</div>'
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            f'content="width=device-width"><title>{html.escape(title)}</title></head>'
            f'<body style="margin:2em auto;padding:0 1em;max-width:1000px">{body}</body></html>\n')


def render_html(r) -> str:
    return page(f"trainfast doctor — {r.model}", render_fragment(r))
