"""What the script doctor measured (ScriptReport) and how it reads: the text report and the page."""

from __future__ import annotations

import html
from collections import Counter
from dataclasses import asdict, dataclass, field

from trainfast import units
from trainfast.diagnose.probes import Step
from trainfast.diagnose.verdict import HIGHLY_INPUT_BOUND, MODERATELY_INPUT_BOUND, Recommendation

SCHEMA_VERSION = 1


@dataclass
class ScriptReport:
    """What `doctor_script` measured; `.text()`, `.to_dict()` and `.html()` render it."""

    command: list[str]
    framework: str  # "pytorch", "keras" or "none" (it never trained)
    stopped: str  # why the run ended
    steps: list[Step]
    warmup: int
    system: dict
    data_source: dict = field(default_factory=dict)  # kind, num_workers, pin_memory, batch_size ...
    devices: dict = field(default_factory=dict)  # "model": [...], "batches": [...]
    batches_drawn: int = 0
    generator_s_per_batch: float | None = None
    data_functions: list[tuple[str, float]] = field(default_factory=list)  # (name, share of data samples)
    busy_functions: list[tuple[str, float]] = field(default_factory=list)  # whole-run samples (never trained)
    layers: list[dict] = field(default_factory=list)
    model: dict = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)
    recommendations: list[Recommendation] = field(default_factory=list)  # measured fixes, best first
    load_warning: str = ""  # other programs kept cores busy while the script ran
    other_cores: float | None = None
    error: str = ""  # the script's own traceback, when it failed
    seconds: float = 0.0
    steps_per_epoch: int | None = None
    epochs: list[tuple[float, int]] = field(default_factory=list)  # (seconds, steps) of whole epochs seen, after warm-up

    @property
    def timed(self) -> list[Step]:
        return self.steps[self.warmup:] if len(self.steps) > self.warmup else self.steps[1:]

    def mean(self, stage: str) -> float:
        t = self.timed
        if stage == "data" and self.fetched_ahead:
            return sum(min(s.generator, s.seconds) for s in t) / len(t)
        return sum(getattr(s, stage) for s in t) / len(t) if t else 0.0

    @property
    def batch(self) -> int:
        """The script's batch: the most common one (not an epoch's short last batch); 0 unknown."""
        return Counter(s.batch_size for s in self.timed).most_common(1)[0][0] if self.timed else 0

    @property
    def fetched_ahead(self) -> bool:
        """Keras ran the data source on another thread: its time stands in for the wait (an upper bound)."""
        t = self.timed
        return bool(t) and self.framework == "keras" and sum(s.data for s in t) == 0 and sum(s.generator for s in t) > 0

    @property
    def data_share(self) -> float:
        step = self.mean("seconds")
        return min(self.mean("data") / step, 1.0) if step else 0.0

    @property
    def verdict(self) -> str:
        if not self.timed:
            return ("never trained: no training step completed" if not self.steps else
                    "too few steps to judge: only the warm-up step completed")
        d = self.data_share
        if d >= HIGHLY_INPUT_BOUND:
            return f"highly input-bound: {d:.0%} of each step waits for data (≥ {HIGHLY_INPUT_BOUND:.0%})"
        if d >= MODERATELY_INPUT_BOUND:
            return f"moderately input-bound: {d:.0%} of each step waits for data"
        return f"not input-bound: data wait is {d:.0%} of the step; the model's own work sets the pace"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(schema=SCHEMA_VERSION, verdict=self.verdict, data_share=self.data_share,
                 mean={s: self.mean(s) for s in ("seconds", "data", "backward", "optimizer")})
        return d

    def text(self) -> str:
        return render_text(self)

    def html(self) -> str:
        return render_html(self)



def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} "


PACE_APART = 1.5  # the script's epoch or its later steps this far from the timed step: the report says so


def pace_findings(r: ScriptReport) -> list[str]:
    """Where the timed step may not be what a whole epoch feels like: a whole epoch seen in the
    run at another pace, or steps that slowed down (or sped up) as the run went on."""
    if not r.timed:
        return []
    step, out = r.mean("seconds"), []
    if r.epochs:  # the first whole epoch seen
        seconds, steps = r.epochs[0]
        per_step = seconds / steps
        ratio = per_step / step
        if ratio > PACE_APART or ratio < 1 / PACE_APART:
            out.append(f"a whole epoch of the script took {seconds:.1f} s for {steps} steps, {units.ms(per_step)} ms per "
                       f"step: ×{ratio:.2f} the {units.ms(step)} ms the timed steps give. Trust the epoch for how long "
                       "training takes: it counts what happens between the steps (validation, callbacks, saving, the "
                       "data's start each epoch); the timed steps say where the time inside a step goes")
    thirds = len(r.timed) // 3
    if thirds >= 2:
        first = sum(s.seconds for s in r.timed[:thirds]) / thirds
        last = sum(s.seconds for s in r.timed[-thirds:]) / thirds
        if last > PACE_APART * first or first > PACE_APART * last:
            how = ("slowed down" if last > first else "sped up")
            out.append(f"the steps {how} as the script ran: {units.ms(first)} ms each in the first {thirds} timed, "
                       f"{units.ms(last)} ms in the last {thirds}. An epoch runs at the later pace"
                       + (" or slower (a prefetch buffer or a cache running out, files read cold)" if last > first else
                          " (the first steps still warmed up)")
                       + ": trust the last steps, and run the doctor longer (--seconds, --steps) to see where "
                       "the pace settles")
    return out


def stage_parts(r: ScriptReport) -> list[tuple[str, float]]:
    """(stage, mean seconds per step) as far as the script's framework lets them be told apart."""
    parts = [("data wait", r.mean("data"))]
    if r.framework == "pytorch":
        parts += [("backward", r.mean("backward")), ("optimizer", r.mean("optimizer"))]
    rest = "forward+rest" if r.framework == "pytorch" else "train step"
    return parts + [(rest, max(r.mean("seconds") - sum(v for _, v in parts), 0.0))]


def render_html(r: ScriptReport) -> str:
    """As the data doctor's page: the verdict, a busy machine, What to do (the measured fixes with
    their commands, then the findings), where the data time goes, the step and per-layer charts,
    then the full text report."""
    from trainfast.diagnose.report import layers_chart, page, recommendations_html, stages_chart
    e = html.escape
    body = [f'<p class="verdict">{e(r.verdict)}</p>']
    if r.load_warning:
        body.append(f'<p class="warning"><b>Busy machine:</b> {e(r.load_warning)}</p>')
    if r.recommendations or r.findings:
        body.append("<h2>What to do</h2>")
    if r.recommendations:
        body.append(recommendations_html(r.recommendations))
    if r.findings:
        body.append("<ul>" + "".join(f"<li>{e(f)}</li>" for f in r.findings) + "</ul>")
    if r.data_functions:
        body.append("<h2>Where the data time goes</h2><ul>"
                    + "".join(f"<li>{share:.0%} {e(name)}</li>" for name, share in r.data_functions) + "</ul>")
    if r.timed:
        body.append(f'<h2>Step-time breakdown</h2><div id="step-breakdown">'
                    f'{stages_chart([(n, v * 1e3) for n, v in stage_parts(r)])}</div>')
    rows = [(l["name"], l["kind"], l["flops"], l["params"]) for l in r.layers if l["params"] or l["flops"]]
    if rows:
        body.append(f'<h2>Per-layer cost</h2><div id="layer-cost">{layers_chart(rows)}</div>')
    body.append(f"<details><summary>Full report (text)</summary><pre>{e(render_text(r))}</pre></details>")
    return page(f"trainfast doctor — {' '.join(r.command)}", "".join(body))


def render_text(r: ScriptReport) -> str:
    lines = [f"trainfast doctor — {' '.join(r.command)}",
             f"{r.framework if r.framework != 'none' else 'no training steps seen'}; {r.stopped}; "
             f"{len(r.timed)} timed steps after {r.warmup} warm-up; device {r.system['device']}", "",
             f"VERDICT  {r.verdict}"]
    if r.load_warning:
        lines.append(f"WARNING  {r.load_warning}")
    if r.timed:
        step = r.mean("seconds")
        bs = r.batch
        rate = f"; {units.rate(bs / step)} images/s at batch {bs}" if bs else ""
        epoch = (f"; an epoch of {r.steps_per_epoch:,} steps: {units.duration(step * r.steps_per_epoch)} at this pace"
                 if r.steps_per_epoch else "")
        lines.append(f"         {units.ms(step)} ms per step{rate}{epoch}")
        lines += ["", "Where the time goes (mean per step)"]
        for name, v in stage_parts(r):
            share = v / step if step else 0.0
            lines.append(f"  {name:12s} {'█' * round(share * 40):40s} {units.ms(v):>9s} ms {share:5.0%}")
    if r.data_source or r.batches_drawn:
        lines += ["", "Data pipeline"]
        if r.data_source:
            lines.append("  " + ", ".join(f"{k} {v}" for k, v in r.data_source.items()))
        alone = r.data_source.get("kind") == "tf.data Dataset"
        lines.append((f"  batches drawn: {r.batches_drawn}" if not alone else "  timed alone after the run")
                     + (f"; the {'dataset' if alone else 'generator'} takes {units.ms(r.generator_s_per_batch)} "
                        "ms per batch" if r.generator_s_per_batch else ""))
        if r.data_functions:
            lines.append("  where the data time goes (share of sampled time inside the data pipeline):")
            lines += [f"    {share:5.0%}  {name}" for name, share in r.data_functions]
    if r.busy_functions:
        lines += ["", "What the script did instead (share of sampled time)"]
        lines += [f"    {share:5.0%}  {name}" for name, share in r.busy_functions]
    if r.recommendations:
        from trainfast.diagnose.report import recommendation_lines
        lines += ["", "What to do, ranked by expected gain"] + recommendation_lines(r.recommendations)
    if r.findings:
        lines += ["", "Findings"] + [f"  - {f}" for f in r.findings]
    s = r.system
    lines += ["", "System",
              f"  CPU {s['cpu']}: {s['physical_cores']} physical cores ({s['usable_cores']} usable), torch "
              f"{s['torch_threads']} threads; CUDA {'available' if s['cuda_available'] else 'not available'}; "
              f"torch {s['torch']}"]
    where = [f"{what} {', '.join(r.devices[key])}" for key, what in (("model", "model on"), ("batches", "batches drawn on"))
             if r.devices.get(key)]  # a Keras script's batches are its backend's: not seen, not said
    if where:
        lines.append(f"  {'; '.join(where)}")
    if r.layers:
        m = r.model
        lines += ["", f"Model{' ' + m['class'] if m.get('class') else ''}: {m['params']:,} parameters, "
                      f"{_si(m['forward_flops'])}FLOP forward per image"]
        for l in r.layers:
            ps = l["params"] / max(m["params"], 1)
            fs = l["flops"] / max(m["forward_flops"], 1)
            lines.append(f"  {l['name'][:22]:22s} {l['kind'][:14]:14s} {'×'.join(map(str, l['output'])):>14s} "
                         f"{l['params']:>11,} {ps:4.0%} {_si(l['flops']):>9s} {fs:4.0%}")
    lines += ["", f"({r.seconds:.0f} s)"]
    return "\n".join(lines)

