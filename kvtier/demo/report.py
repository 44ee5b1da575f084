"""What the demo prints: a progress bar with one line per turn, then the summary; and the plot."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

_ROW = "{:>2} {:<7} {:<26} {:>6} {:>15} {:>5} {:>8} {:>8} {:>7} {:>6} {:>5}"
HEADER = _ROW.format("#", "user", "request", "ctx", "hit (tier)", "new", "cold", "kvtier", "speedup", "eff", "same")


def _tiers(tokens_by_tier: dict[str, int]) -> str:
    if not tokens_by_tier:
        return "-"
    return "+".join(f"{n}{tier[0]}" for tier, n in tokens_by_tier.items())


def turn_row(t: dict) -> str:
    hit = f"{t['cached_tokens']} ({_tiers(t['tokens_by_tier'])})" if t["cached_tokens"] else "0"
    # load efficiency: the load's bytes at the tiers' limits over its measured time
    eff = f"{t['load_efficiency']:.2f}" if t.get("load_efficiency") else "-"
    return _ROW.format(
        t["index"] + 1, t["session"], t["label"][:26], t["context_tokens"], hit, t["computed_tokens"],
        f"{t['ttft_cold_s']:.2f}s", f"{t['ttft_warm_s']:.3f}s", f"{t['speedup']:.1f}x", eff,
        "yes" if t["outputs_equal"] else "NO",
    )


class Reporter:
    """Renders worker events. With ``quiet_stdout`` (``--json``) everything goes to stderr."""

    def __init__(self, total_turns: int, *, quiet_stdout: bool) -> None:
        out = sys.stderr if quiet_stdout else sys.stdout
        # Rows are ~100 columns; rich assumes 80 when the output is not a terminal.
        self.console = Console(file=out, highlight=False, width=None if out.isatty() else 120)
        self.progress = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=self.console, transient=True,
        )
        self.task = self.progress.add_task("starting", total=total_turns)

    def __enter__(self):
        self.progress.__enter__()
        self.console.print(HEADER, style="bold")
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def note(self, text: str) -> None:
        self.progress.console.print(text, style="dim")

    def status(self, text: str) -> None:
        self.progress.update(self.task, description=text)

    def on_event(self, event: dict) -> None:
        kind = event["event"]
        if kind == "model_built":
            self.note(f"   built the demo model once in {event['seconds']:.1f} s: {event['path']}")
        elif kind == "ready":
            limits = ", ".join(f"{k} {v:.1f} GiB/s" for k, v in event["limits_gib_s"].items())
            self.note(
                f"   engine process {event['pid']} ready: model loaded in {event['model_load_s']:.2f} s, "
                f"store opened in {event['store_open_s'] * 1000:.0f} ms (disk tier: {event['recovered_blocks']} blocks); "
                f"limits measured now: {limits}; {event['threads']} threads, "
                f"block {event['block_tokens']} tokens x {event['bytes_per_token'] // 1024} KiB"
            )
        elif kind == "note":
            self.note(f"   {event['text']}")
        elif kind == "warning":
            self.progress.console.print(f"   WARNING: {event['text']}", style="bold red")
        elif kind == "start":
            self.status(f"{event['session']}: {event['label']} ({event['context_tokens']} tokens) - recompute")
        elif kind == "cold_done":
            self.status(self.progress.tasks[0].description.replace("- recompute", "- kvtier"))
        elif kind == "turn":
            self.progress.console.print(turn_row(event))
            self.progress.advance(self.task)

    def restart(self, recovered_note: str) -> None:
        self.progress.console.print(f"-- restart: {recovered_note}", style="bold yellow")


def print_summary(console: Console, s: dict) -> None:
    table = Table(title=f"kvtier demo ({s['scenario']}): load instead of recompute", show_header=True)
    table.add_column("figure")
    table.add_column("without kvtier", justify="right")
    table.add_column("with kvtier", justify="right")
    table.add_row("TTFT p50", f"{s['ttft_cold_p50_s']:.2f} s", f"{s['ttft_warm_p50_s']:.3f} s")
    table.add_row("TTFT p90", f"{s['ttft_cold_p90_s']:.2f} s", f"{s['ttft_warm_p90_s']:.3f} s")
    table.add_row("CPU-seconds to first tokens", f"{s['cpu_seconds_cold']:.1f}", f"{s['cpu_seconds_warm']:.1f}")
    console.print(table)
    mib = lambda d: ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in d.items()) or "-"  # noqa: E731
    lines = [
        f"speedup p50 over all {s['turns']} turns: {s['speedup_p50']:.1f}x   "
        f"hit rate {s['hit_rate'] * 100:.0f}% of context tokens   CPU-seconds saved {s['cpu_seconds_saved']:.1f}",
    ]
    if s.get("load_efficiency_p50"):
        per_tier = ", ".join(f"{tier} {v:.2f}" for tier, v in s["load_efficiency_p50"].items())
        lines.append(f"load efficiency p50 (bytes at the tier's limit, read and copied as kvtier does: host = the same "
                     f"blocks into the KV storage's layout, / load time; host+disk = turns loading from both, "
                     f"at once: the longer part at its limit): {per_tier}; "
                     f"lookup + load over that ideal: p50 {s['overhead_ratio_p50']:.2f}, p90 {s['overhead_ratio_p90']:.2f}")
    if s.get("load_efficiency_vs_memcpy_p50"):
        per_tier = ", ".join(f"{tier} {v:.2f}" for tier, v in s["load_efficiency_vs_memcpy_p50"].items())
        lines.append(f"load efficiency p50 with the host part against a contiguous 64 MiB memcpy (not the load's copy; "
                     f"the figure posted before): {per_tier}")
    if s.get("lookup_s_p50") is not None:
        lines.append(f"per turn with a hit, p50: lookup {s['lookup_s_p50'] * 1e3:.2f} ms, load {s['load_s_p50'] * 1e3:.1f} ms, "
                     f"prefill of the rest {s['prefill_s_p50'] * 1e3:.0f} ms")
    if "resume_speedup" in s:
        lines.append(
            f"resume ({s['resume_context_tokens']}-token context, {s['resume_new_tokens']} new, from "
            f"{'+'.join(s['resume_tiers'])}): {s['resume_ttft_cold_s']:.1f} s -> {s['resume_ttft_warm_s']:.3f} s = "
            f"{s['resume_speedup']:.0f}x"
        )
    if "resume_after_restart_speedup" in s:
        lines.append(f"resume after the restart (from {'+'.join(s['resume_after_restart_tiers'])}): "
                     f"{s['resume_after_restart_speedup']:.0f}x")
    if "restart" in s:
        r = s["restart"]
        lines.append(f"restart: new process serving after {r['new_process_ready_s']:.1f} s "
                     f"(model load {r['model_load_s']:.2f} s); disk tier re-indexed {r['disk_blocks_recovered']} blocks")
    lines += [
        f"bytes loaded: {mib(s['bytes_loaded_by_tier'])}; written: {mib(s['bytes_written_by_tier'])}; "
        f"held at the end: {mib(s['bytes_used_by_tier'])}",
        f"outputs equal (greedy tokens, kvtier vs recompute): {'yes' if s['outputs_equal'] else 'NO'}; "
        f"max |logit difference| {_logits_diff(s)} (allowed: the dtype's rounding, 1e-3 x max |logit| in fp32)",
        f"a TTFT under 1 s is the median of up to 3 identical runs (runs per turn without kvtier "
        f"{s['runs_per_turn']['without']}, with {s['runs_per_turn']['with']}); runtime {s['runtime_s']:.0f} s",
    ]
    for line in lines:
        console.print(line)


def _logits_diff(s: dict) -> str:
    if s.get("logits_nan"):
        return "NaN (a turn's logits were NaN: its load left the poisoned KV in place)"
    if s["logits_max_abs_diff"] is None:
        return "-"
    off = s.get("logits_off_turns")
    return f"{s['logits_max_abs_diff']:.2e}" + (f", over the tolerance on turns {off}" if off else "")


def plot(turns: list[dict], path: str, restart_after: list[int]) -> None:
    """TTFT per turn, recompute vs kvtier, log scale (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(len(turns)))
    fig, ax = plt.subplots(figsize=(max(6, len(turns) * 0.8), 4.5))
    width = 0.4
    ax.bar([x - width / 2 for x in xs], [t["ttft_cold_s"] for t in turns], width, label="without kvtier (recompute)")
    ax.bar([x + width / 2 for x in xs], [t["ttft_warm_s"] for t in turns], width, label="with kvtier (load)")
    for x, t in zip(xs, turns):
        ax.annotate(f"{t['speedup']:.0f}x", (x + width / 2, t["ttft_warm_s"]), ha="center", va="bottom", fontsize=8)
    top = max(t["ttft_cold_s"] for t in turns)
    for k in restart_after:
        ax.axvline(k - 0.5, color="grey", linestyle="--")
        ax.text(k - 0.45, top, "process restart", color="grey", fontsize=8, va="top")
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (s)")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{t['session']}\n{t['label'][:24]}" for t in turns], fontsize=7, rotation=30, ha="right")
    ax.legend()
    ax.set_title("kvtier demo: TTFT per turn")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
