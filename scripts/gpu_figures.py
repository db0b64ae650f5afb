"""The figures the GPU path's bars need, from what scripts/gpu_check.sh's stages left in its
output folder; the figures table at the top of its report.md.

    python scripts/gpu_figures.py bench-out/gpu

It reads the stages' JSON (the pair's pair/pair.json, ceiling.json, reference.json,
served.json, served-graphs.json), the exactness stage's pytest summary and each stage's
closing `[name: exit rc after N s]` line, and prints, eager beside --cuda-graphs:
- served ÷ the models alone, at 1 in flight over the same prompts and token counts;
- fixed γ=4 and AUTO ÷ target-only, served at 1 and 32 in flight;
- acceptance, each model's ms per forward, c (draft ÷ target), v (a verification's
  γ + 1 tokens ÷ one token) and the speed-up they predict beside the one measured;
- greedy agreement with transformers on the device;
- the projection for an 8B/1B pair (`projection`), and each stage's wall time.
A figure a stage has not produced yet reads "—"; on a CPU (the dry run) the graphs column
reads "n/a (CPU)": nothing can be captured there, though the stages ran the same code.
Needs nothing beyond the standard library, so it runs where torch is missing.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

STAGES = ("env", "pair", "forwards", "ceiling", "reference", "served", "served-graphs", "exactness")
# Acceptance per position at which the 8B/1B projection is also given: a real pair's depends
# on its task, and this pair's is set by construction (scripts/gpu_check.py make-pair).
PROJECTED_ALPHAS = (0.6, 0.7, 0.8)
MAX_GAMMA = 8  # the longest draft the projection's best γ is chosen from
MISSING = "—"


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a step gives when each drafted position is accepted with probability `alpha`
    independently of the others: the accepted prefix and the target's own token,
    (1 − α^(γ+1)) / (1 − α) (Leviathan et al., 2023)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def alpha_from_tokens(tokens_per_step: float, gamma: int) -> float:
    """The acceptance per position whose `expected_tokens` is `tokens_per_step` (bisection:
    expected_tokens rises with α)."""
    low, high = 0.0, 1.0
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if expected_tokens(middle, gamma) < tokens_per_step else (low, middle)
    return (low + high) / 2


def speedup(alpha: float, gamma: int, c: float, v: float) -> float:
    """Speculative ÷ target-only tokens/s: E[tokens] / (γc + v), the step's γ draft forwards
    at c target forwards each and its verification at v."""
    return expected_tokens(alpha, gamma) / (gamma * c + v)


def projection(alphas: list[tuple[str, float]], gamma: int, c: float, v: float) -> list[str]:
    """Rows of `speedup` at each α: at `gamma`, and at the best γ up to MAX_GAMMA (v held at
    its measured value: a verification of up to 9 tokens costs about one token's forward
    where the forward is bound by reading the weights)."""
    rows = []
    for name, alpha in alphas:
        best = max(range(1, MAX_GAMMA + 1), key=lambda g: speedup(alpha, g, c, v))
        rows.append(f"  α {alpha:.2f} {name:<12} E[tokens] {expected_tokens(alpha, gamma):4.2f}   γ={gamma}: "
                    f"{speedup(alpha, gamma, c, v):4.2f}×   best γ={best}: {speedup(alpha, best, c, v):4.2f}×")
    return rows


def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _row(served: dict | None, label: str, concurrency: int) -> dict | None:
    if not served:
        return None
    return next((r for r in served.get("rows", []) if r["label"] == label and r["concurrency"] == concurrency), None)


def _ratio(top: Any, bottom: Any) -> str:
    return f"{top / bottom:.2f}" if top and bottom else MISSING


def _number(value: float | None, form: str = ".2f") -> str:
    return MISSING if value is None else format(value, form)


def stage_times(out: Path) -> str:
    """Each stage's wall time and exit status, from the last line its log ends with."""
    parts = []
    for name in STAGES:
        log = out / f"{name}.txt"
        found = re.findall(r"^\[\S+: exit (\d+) after (\d+) s(, out of time)?\]$", log.read_text(), re.M) \
            if log.is_file() else []
        if found:
            status, seconds, late = found[-1]
            parts.append(f"{name} {seconds} s" + ("" if status == "0" else f" (exit {status}{late})"))
        else:
            parts.append(f"{name} not run")
    return ", ".join(parts)


def agreement(served: dict | None) -> list[str]:
    """One line per configuration: prompts whose greedy tokens equal transformers', and where
    the others part."""
    if not served or not served.get("agreement"):
        return [f"  {MISSING} (no served run, or no reference: the reference stage)"]
    lines = []
    for result in served["agreement"]["configs"]:
        parted = [f"prompt {i} at token {d}" for i, d in enumerate(result["first_divergence"]) if d is not None]
        lines.append(f"  {result['label']:<16} {result['same']}/{result['prompts']} prompts token for token"
                     + (f"; first divergence: {', '.join(parted)}" if parted else ""))
    return lines


def figures(out: Path) -> str:
    pair = _load(out / "pair" / "pair.json")
    ceiling = _load(out / "ceiling.json")
    reference = _load(out / "reference.json")
    served = {"eager": _load(out / "served.json"), "graphs": _load(out / "served-graphs.json")}
    cpu = (ceiling or reference or served["eager"] or {}).get("device", "") == "cpu"
    modes = ("eager", "graphs")
    alone = {mode: (ceiling or {}).get("modes", {}).get(mode) for mode in modes}

    def columns(name: str, value) -> str:  # value(mode) → text; "n/a (CPU)" for graphs on a CPU
        cells = [value("eager"), "n/a (CPU)" if cpu else value("graphs")]
        return f"{name:<58} {cells[0]:>10}   {cells[1]:>10}"

    def measured(mode: str, key: str, form: str = ".2f") -> str:
        return _number((alone[mode] or {}).get(key), form)

    def served_ratio(mode: str, label: str, n: int) -> str:
        row, off = _row(served[mode], label, n), _row(served[mode], "target-only", n)
        return _ratio(row and row["tokens_per_s"], off and off["tokens_per_s"])

    def served_alone(mode: str, label: str, key: str) -> str:
        row = _row(served[mode], label, 1)
        return _ratio(row and row["tokens_per_s"], (alone[mode] or {}).get(key))

    def predicted(mode: str) -> str:
        m = alone[mode]
        if not m or not m.get("c"):
            return MISSING
        return f"{m['tokens_per_step'] / (ceiling['gamma'] * m['c'] + m['v']):.2f}"

    gamma = (ceiling or {}).get("gamma", 4)
    fixed, auto = f"fixed γ={gamma}", "cost (AUTO)"
    lines = [f"{'figure':<58} {'eager':>10}   {'--cuda-graphs':>10}"]
    lines += [
        columns("models alone: target-only tokens/s", lambda m: measured(m, "target_only_tokens_per_s", ".1f")),
        columns(f"models alone: {fixed} ÷ target-only (measured)", lambda m: measured(m, "ratio")),
        columns("  predicted E[tokens]/(γc+v)", predicted),
        columns("served target-only ÷ models alone (1 in flight)",
                lambda m: served_alone(m, "target-only", "target_only_tokens_per_s")),
        columns(f"served {fixed} ÷ models alone (1 in flight)",
                lambda m: served_alone(m, fixed, "fixed_tokens_per_s")),
    ]
    for n in sorted({r["concurrency"] for s in served.values() if s for r in s.get("rows", [])}):
        lines += [columns(f"served {fixed} ÷ target-only, {n} in flight", lambda m, n=n: served_ratio(m, fixed, n)),
                  columns(f"served AUTO ÷ target-only, {n} in flight", lambda m, n=n: served_ratio(m, auto, n))]
        lines.append(columns(f"  acceptance (accepted ÷ proposed), {fixed}, {n} in flight",
                             lambda m, n=n: _number((_row(served[m], fixed, n) or {}).get("acceptance_rate"))))
    lines += [
        columns(f"models alone: tokens per step, {fixed}", lambda m: measured(m, "tokens_per_step")),
        columns("  α per position (from tokens per step)", lambda m: _number(
            alpha_from_tokens(alone[m]["tokens_per_step"], gamma) if alone[m] else None)),
        columns("draft ms per forward (1–2 tokens)", lambda m: measured(m, "draft_ms", ".3f")),
        columns("target ms per forward (1 token)", lambda m: measured(m, "target_ms", ".3f")),
        columns(f"target ms per forward ({gamma + 1} tokens: a verification)",
                lambda m: measured(m, "verify_ms", ".3f")),
        columns("c = draft ms ÷ target ms", lambda m: measured(m, "c", ".3f")),
        columns(f"v = {gamma + 1} tokens' ms ÷ 1 token's", lambda m: measured(m, "v", ".3f")),
    ]
    if ceiling:
        tokens = {mode: alone[mode]["target_only_tokens"] for mode in modes if alone[mode]}
        counts = ", ".join(f"{mode} {count}" for mode, count in tokens.items())
        served_counts = ", ".join(f"{mode} {row['tokens']}" for mode in modes
                                  if (row := _row(served[mode], "target-only", 1)))
        lines.append(f"tokens each way at 1 in flight: models alone {counts}; served {served_counts or MISSING}")
    if pair:
        lines.append(f"the pair: draft reads {pair['read_ratio']:.3f} of the target's weights per forward "
                     f"(Llama 3.2 1B ÷ Llama 3.1 8B: {pair['llama_read_ratio']:.3f}); made with the target "
                     f"off its bigram at {pair['departure']:.2f} of positions, the draft agreeing at "
                     f"{pair['agreement']:.2f}")
    where = f"{reference['dtype']} on {reference['device']}" if reference else MISSING
    for mode in modes:
        title = "eager" if mode == "eager" else "--cuda-graphs" + (" (left out on a CPU)" if cpu else "")
        lines.append(f"greedy agreement with transformers' generate ({where}), served {title}:")
        lines += agreement(served[mode])
    for mode in [m for m in modes if alone[m] and alone[m].get("c") and not (cpu and m == "graphs")]:
        m = alone[mode]
        alphas = [("(this pair)", alpha_from_tokens(m["tokens_per_step"], gamma))]
        alphas += [("", a) for a in PROJECTED_ALPHAS]
        lines.append(f"8B/1B projection, {'--cuda-graphs' if mode == 'graphs' else 'eager'}: this pair's c "
                     f"{m['c']:.3f} and v {m['v']:.3f} stand for an 8B/1B's (its draft reads the share of the "
                     f"target's weights given above); speed-up = E[tokens]/(γc+v), E[tokens] = (1−α^(γ+1))/(1−α), "
                     f"v held for every γ:")
        lines += projection(alphas, gamma, m["c"], m["v"])
    exactness = out / "exactness.txt"
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", exactness.read_text(), re.M) \
        if exactness.is_file() else []
    lines.append(f"exactness tests: {summary[-1] if summary else MISSING}")
    lines.append(f"wall time by stage: {stage_times(out)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(figures(Path(sys.argv[1])))
