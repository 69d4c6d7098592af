"""The doctor's report as text (verdict first, then the evidence) and as a self-contained
HTML page with a step-time breakdown chart and a per-layer cost chart (inline SVG).
"""

from __future__ import annotations

import html
import io

from trainfast.diagnose.timing import STAGES

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
             f"batch {t.batch_size}, {r.speed.label()}, device {r.system['device']}, {t.steps} timed steps", ""]
    lines.append(f"VERDICT  {r.verdict.sentence}")
    if r.load_warning:
        lines.append(f"WARNING  {r.load_warning}")
    compute_rate = t.images_per_s * t.step / max(t.step - t.data, 1e-12)  # the same rate without the data wait
    how = " (steps back to back; the stage times below synchronise every step)" if t.steady else ""
    lines.append(f"         {t.images_per_s:,.0f} images/s now{how}; the compute side alone runs at "
                 f"{compute_rate:,.0f} images/s")
    lines.append(f"         roofline {roof.bound_s * 1e3:.3f} ms/image vs {roof.measured_s * 1e3:.3f} ms measured "
                 f"({roof.share_of_peak:.1%} of the {roof.dtype} peak)")
    if r.storage:
        lines.append(f"STORAGE  {r.storage['sentence']}")
    lines += ["", "Where the time goes (median per step)"]
    for s in STAGES:
        v, share = getattr(t, s), t.share(s)
        lines.append(f"  {_STAGE_NAMES[s]:12s} {'█' * round(share * 40):40s} {v * 1e3:9.1f} ms {share:5.0%}")
    lines.append(f"  {'step':12s} {'':40s} {t.step * 1e3:9.1f} ms")
    if r.recommendations:
        lines += ["", "What to do, ranked by expected gain"]
        for i, rec in enumerate(r.recommendations, 1):
            gain = f"×{rec.speedup:.2f} {'measured' if rec.measured else 'estimate'}" if rec.speedup else "—"
            lines.append(f"  {i}. {rec.title}  [{gain}]")
            if rec.evidence:
                lines.append(f"     {rec.evidence}")
            for a in rec.action.splitlines():
                lines.append(f"       {a}")
    s = r.system
    p = r.peaks
    lines += ["", "System"]
    gpus = ", ".join(f"{g['name']} (sm{g['compute_capability']}, {g['memory_gb']} GB)" for g in s["gpus"]) or "none usable"
    lines.append(f"  device in use {s['device']}; GPUs: {gpus}; torch {s['torch']}")
    lines.append(f"  CPU {s['cpu']}: {s['physical_cores']} physical cores, torch uses {s['torch_threads']} threads; "
                 f"ISA {' '.join(s['isa']) or '—'}")
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
    if cost.findings:
        lines += ["", "Findings about the model"]
        lines += [f"  - {f}" for f in cost.findings]
    lines += ["", f"({r.seconds:.0f} s)"]
    return "\n".join(lines)


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]


def step_chart(r) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = r.times
    fig, ax = plt.subplots(figsize=(8, 1.8))
    left = 0.0
    colours = ["#d62728", "#9467bd", "#1f77b4", "#2ca02c", "#ff7f0e", "#7f7f7f"]
    for s, c in zip(STAGES, colours):
        v = getattr(t, s) * 1e3
        ax.barh([0], [v], left=left, color=c, label=f"{_STAGE_NAMES[s]} {v:.1f} ms")
        left += v
    ax.set_yticks([])
    ax.set_xlabel("ms per step (median)")
    ax.legend(ncol=3, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.45), frameon=False)
    ax.set_title("Where each training step's time goes")
    svg = _svg(fig)
    plt.close(fig)
    return svg


def layer_chart(r) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [l for l in r.cost.layers if l.params or l.flops]
    names = [f"{l.name} ({l.kind})" for l in layers]
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.3 * len(layers) + 1.2), sharey=True)
    axes[0].barh(names, [l.flops / 1e6 for l in layers], color="#1f77b4")
    axes[0].set_xlabel("forward MFLOPs per image")
    axes[1].barh(names, [l.params / 1e3 for l in layers], color="#ff7f0e")
    axes[1].set_xlabel("parameters (thousands)")
    axes[0].invert_yaxis()
    fig.suptitle("Per-layer cost: FLOPs hold the time, parameters the memory")
    svg = _svg(fig)
    plt.close(fig)
    return svg


def render_html(r) -> str:
    body = html.escape(render_text(r))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>trainfast doctor — {html.escape(r.model)}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em}}
pre{{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:13px}} h1{{font-size:1.4em}}
.verdict{{font-size:1.2em;padding:.6em;background:#fff3cd;border-left:4px solid #e0a800}}</style></head>
<body><h1>trainfast doctor — {html.escape(r.model)} on {html.escape(r.data)}</h1>
<p class="verdict">{html.escape(r.verdict.sentence)}</p>
<h2>Step-time breakdown</h2><div id="step-breakdown">{step_chart(r)}</div>
<h2>Per-layer cost</h2><div id="layer-cost">{layer_chart(r)}</div>
<h2>Full report</h2><pre>{body}</pre></body></html>
"""
