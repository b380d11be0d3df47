"""A serving run's figures: per arm, then each arm as ratios to the engine-only arm.

Throughput is counted per second of engine work (``busy_s``, the steps' wall time). At an
offered load every arm sustains, tokens per wall-clock second are the offered load in every arm
and say nothing about the engine; tokens per busy second are the rate each arm could sustain on
this mix of requests, which is what a cache below the GPU changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.bench.serve.arms import TITLES, ArmResult

RATIO_KEYS = (
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "prompt_tokens_per_s",
    "output_tokens_per_s",
    "prefill_tokens_computed",
)


def ttfts_ms(arm: ArmResult) -> list[float]:
    return [o.ttft_s * 1000 for o in arm.loop.outcomes]


def arm_summary(arm: ArmResult) -> dict[str, object]:
    loop = arm.loop
    ttft = np.array(ttfts_ms(arm))
    p50, p90, p99 = (float(np.percentile(ttft, q)) for q in (50, 90, 99))
    prompt = sum(o.prompt_tokens for o in loop.outcomes)
    output = sum(o.output_tokens for o in loop.outcomes)
    busy = max(loop.busy_s, 1e-9)
    hits = arm.hit_tokens or {
        "gpu": sum(o.gpu_hit_tokens for o in loop.outcomes),
        "host": sum(o.host_hit_tokens for o in loop.outcomes),
        "disk": sum(o.disk_hit_tokens for o in loop.outcomes),
    }
    return {
        "name": arm.name,
        "requests": len(loop.outcomes),
        "ttft_p50_ms": round(p50, 2),
        "ttft_p90_ms": round(p90, 2),
        "ttft_p99_ms": round(p99, 2),
        "ttft_mean_ms": round(float(ttft.mean()), 2),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "prompt_tokens_per_s": round(prompt / busy, 1),
        "output_tokens_per_s": round(output / busy, 2),
        "prefill_tokens_computed": prompt - sum(hits.values()),
        "hit_tokens": hits,
        "busy_s": round(loop.busy_s, 3),
        "admit_s": _round(loop.admit_s),
        "decode_s": _round(loop.decode_s),
        "prefill_s": _round(loop.prefill_s),
        "span_s": round(loop.span_s, 3),
        "busy_fraction": round(loop.busy_s / loop.span_s, 3) if loop.span_s else None,
        "steps": loop.steps,
        "max_running": loop.max_running,
        "blocks_spilled_to_host": arm.blocks_spilled_to_host,
        "blocks_spilled_to_disk": arm.blocks_spilled_to_disk,
    }


def compare(arms: Sequence[ArmResult]) -> dict[str, object]:
    """``arms`` (the engine-only arm first) with ratios to it, the best kvtier arm's two
    headline ratios, and whether every arm generated the same tokens after the same logits
    (bit for bit) for every request."""
    summaries = [arm_summary(a) for a in arms]
    base = summaries[0]
    for s in summaries:
        s["vs_engine_only"] = {k: _ratio(s[k], base[k]) for k in RATIO_KEYS}
    out: dict[str, object] = {"arms": summaries}
    kvtier = summaries[1:]
    if kvtier:
        best = min(kvtier, key=lambda s: s["ttft_p50_ms"])
        out["best_arm"] = best["name"]
        out["ttft_p50_ratio"] = best["vs_engine_only"]["ttft_p50_ms"]
        out["throughput_ratio"] = best["vs_engine_only"]["prompt_tokens_per_s"]
    outputs = [[(o.tokens, o.first_logits) for o in a.loop.outcomes] for a in arms]
    out["outputs_identical"] = all(o == outputs[0] for o in outputs)
    return out


def _params(count: object) -> str:
    return f" ({count / 1e6:.1f}M parameters)" if isinstance(count, int) else ""


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def _ratio(value: object, base: object) -> float | None:
    if not isinstance(value, int | float) or not isinstance(base, int | float) or not base:
        return None
    return round(value / base, 3)


def print_text(summary: dict[str, object]) -> None:
    s = summary
    sizes = s["sizes"]
    lines = [
        f"serving {s['source']}: {s['requests']} requests ({s['prompt_tokens']} prompt, "
        f"{s['output_tokens']} output tokens; a trace block is {s['block_tokens']} tokens); "
        f"an unbounded cache could supply {s['reusable_prompt_tokens']} prompt tokens",
        f"engine: {s['engine']}, {s['model']}{_params(s['model_params'])} on {s['device']}, "
        f"{s['max_running']} requests in flight at most, {s['step_tokens']}-token steps, "
        f"{s['chunk_tokens']}-token prefill chunks",
        f"tiers (blocks of {s['block_size']} tokens): GPU {sizes['gpu_blocks']} in every arm, "
        f"host {sizes['host_blocks']}, disk {sizes['disk_blocks']}"
        + (" (sized from the requests)" if s["sized_from_requests"] else ""),
        f"clock: {s['clock']}; arrivals: trace time x {s['time_scale']:.4g}"
        + (
            f", offered load {s['load']:.0%} of the engine-only capacity "
            f"({s['engine_capacity_prompt_tokens_per_s']:.0f} prompt tokens/s)"
            if s.get("engine_capacity_prompt_tokens_per_s")
            else ""
        ),
        "",
        f"{'arm':<26}{'TTFT p50':>10}{'p90':>10}{'p99 ms':>10}{'prompt/s':>10}{'output/s':>10}"
        f"{'computed':>10}{'hits gpu/host/disk':>22}",
    ]
    for a in s["arms"]:
        hits = a["hit_tokens"]
        lines.append(
            f"{TITLES[a['name']]:<26}{a['ttft_p50_ms']:>10.0f}{a['ttft_p90_ms']:>10.0f}"
            f"{a['ttft_p99_ms']:>10.0f}{a['prompt_tokens_per_s']:>10.0f}"
            f"{a['output_tokens_per_s']:>10.1f}{a['prefill_tokens_computed']:>10}"
            f"{hits['gpu']:>9}/{hits['host']}/{hits['disk']}"
        )
    lines.append("as ratios to the engine-only arm:")
    for a in s["arms"][1:]:
        r = a["vs_engine_only"]
        lines.append(
            f"{TITLES[a['name']]:<26}{_fmt(r['ttft_p50_ms']):>10}{_fmt(r['ttft_p90_ms']):>10}"
            f"{_fmt(r['ttft_p99_ms']):>10}{_fmt(r['prompt_tokens_per_s']):>10}"
            f"{_fmt(r['output_tokens_per_s']):>10}{_fmt(r['prefill_tokens_computed']):>10}"
        )
    lines += [
        "",
        "tokens per second are per second of engine work (busy): "
        + ", ".join(
            f"{a['name']} {a['busy_s']:.1f} s busy of {a['span_s']:.1f} s" for a in s["arms"]
        ),
    ]
    if "best_arm" in s:
        lines.append(
            f"best kvtier arm {s['best_arm']}: ttft_p50_ratio {_fmt(s['ttft_p50_ratio'])}, "
            f"throughput_ratio {_fmt(s['throughput_ratio'])}; tokens and first logits "
            f"identical in every arm: {s['outputs_identical']}"
        )
    lines.append(f"wall: {s['wall_s']:.1f} s")
    print("\n".join(lines))


def _fmt(value: object) -> str:
    return "n/a" if value is None else f"{value:.3f}"
