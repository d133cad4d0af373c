"""``vllm_gpu.py``'s report: per mode and length each case's TTFT, the ratios the goals name,
greedy-token and first-token-logprob agreement with ``recompute``, the variants' and the
throughput lines, printed as tables. The parent process's main thread runs it once every case
has ended.
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm_gpu_case import THROUGHPUT_NEW, THROUGHPUT_PROMPT, TOP_LOGPROBS, VARIANTS


def summarize(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode and length: each case's TTFT, the ratios the goals name, token agreement."""
    from kvtier.machine import format_table

    by = {(r["case"], r["mode"]): r for r in results}
    summary: dict[str, Any] = {}
    for mode in args.modes:
        rows, table = [], {}
        for length in (*args.lengths, *args.check_lengths):
            key = str(length)

            def cell(case: str, field: str = "ttft_median_ms", key: str = key,
                     mode: str = mode) -> Any:
                run_mode = args.disk_mode if case in ("disk_store", "disk_hit") else mode
                return by.get((case, run_mode), {}).get("lengths", {}).get(key, {}).get(field)

            want_lp = cell("recompute", "first_logprobs")
            lp_diff = {c: _logprob_gap(want_lp, cell(c, "first_logprobs"))
                       for c in ("alone", "native", "kvtier", *VARIANTS, "disk_hit")
                       if cell(c, "first_logprobs")}
            want = cell("recompute", "tokens16")
            agree = {c: (cell(c, "tokens16") == want if want and cell(c, "tokens16") else None)
                     for c in ("alone", "native", "kvtier", *VARIANTS, "disk_hit")}
            line = {"recompute_ms": cell("recompute"), "gpu_hit_ms": cell("alone"),
                    "native_hit_ms": cell("native"), "kvtier_host_hit_ms": cell("kvtier"),
                    "kvtier_disk_first_ms": cell("disk_hit", "first_ttft_ms"),
                    "kvtier_disk_hit_ms": cell("disk_hit"),
                    "alone_unseen_ms": cell("alone", "unseen_ttft_ms"),
                    "kvtier_unseen_ms": cell("kvtier", "unseen_ttft_ms"),
                    "kvtier_cached": cell("kvtier", "cached"),
                    "native_cached": cell("native", "cached"),
                    "tokens_equal": agree,
                    "first_token_logprob_gap": lp_diff}
            ratio = _ratio
            line["kvtier_over_native"] = ratio(line["kvtier_host_hit_ms"], line["native_hit_ms"])
            for variant in VARIANTS:
                line[f"{variant}_host_hit_ms"] = cell(variant)
                line[f"{variant}_over_native"] = ratio(cell(variant), line["native_hit_ms"])
                line[f"{variant}_miss_over_alone"] = ratio(cell(variant, "unseen_ttft_ms"),
                                                           line["alone_unseen_ms"])
            line["recompute_over_disk"] = ratio(line["recompute_ms"], line["kvtier_disk_hit_ms"])
            line["miss_over_alone"] = ratio(line["kvtier_unseen_ms"], line["alone_unseen_ms"])
            table[key] = line
            rows.append([length, line["recompute_ms"], line["gpu_hit_ms"], line["native_hit_ms"],
                         line["kvtier_host_hit_ms"], line["kvtier_over_native"],
                         line["kvtier_disk_hit_ms"], line["recompute_over_disk"],
                         line["miss_over_alone"],
                         " ".join(f"{c}={'y' if v else ('n' if v is False else '-')}"
                                  for c, v in agree.items())])
        for length in (*args.lengths, *args.check_lengths):
            gaps = table[str(length)]["first_token_logprob_gap"]
            if gaps:
                print(f"{length} tokens: first token's top-{TOP_LOGPROBS} logprobs, largest gap "
                      "to recompute's: " + ", ".join(f"{c} {g}" for c, g in gaps.items()))
        variants = [(length, v, table[str(length)][f"{v}_host_hit_ms"],
                     table[str(length)][f"{v}_over_native"],
                     table[str(length)][f"{v}_miss_over_alone"]) for length in args.lengths
                    for v in VARIANTS if table[str(length)][f"{v}_host_hit_ms"] is not None]
        thr = {c: by.get((c, mode), {}).get("throughput") for c in ("alone", "kvtier", *VARIANTS)}
        for c in ("kvtier", *VARIANTS):
            if thr["alone"] and thr[c]:
                thr[f"{c}_over_alone"] = ratio(thr[c]["gen_tok_s"], thr["alone"]["gen_tok_s"])
        table["throughput"] = thr
        summary[mode] = table
        print(f"\n== {mode} (TTFT ms, median of {args.repeats}) ==")
        print(format_table(["tokens", "recompute", "gpu hit", "native hit", "kvtier host",
                            "kv/native", "kvtier disk", "recomp/disk", "miss/alone",
                            "16 tokens = recompute"], rows))
        for length, variant, ms, over, miss in variants:
            print(f"{length} tokens: {variant} ({VARIANTS[variant]}) host hit {ms} ms, "
                  f"{over}x native; miss {miss}x alone")
        for (case, run_mode), res in sorted(by.items()):
            for length, r in res.get("lengths", {}).items():
                for what in ("profile", "profile_unseen"):
                    prof = r.get(what) if run_mode == mode else None
                    if prof:
                        print(f"{case} {length} tokens, one profiled "
                              f"{'hit' if what == 'profile' else 'miss'} ({prof['ttft_ms']} ms)"
                              ", most CUDA time: " + "; ".join(
                                  f"{e['name'][:48]} x{e['calls']} {e['self_cuda_ms']} ms"
                                  for e in prof["by_cuda"][:6]))
        if thr.get("kvtier_over_alone") is not None:
            print(f"throughput, {args.batch} prompts x {THROUGHPUT_PROMPT} tokens, "
                  f"{THROUGHPUT_NEW} new: alone {thr['alone']['gen_tok_s']} gen tok/s, kvtier "
                  f"on (no hit) {thr['kvtier']['gen_tok_s']} ({thr['kvtier_over_alone']}x)")
            spent = thr["kvtier"].get("connector")
            if spent:
                print(f"  kvtier's connector CPU in that run ({thr['kvtier']['seconds']} s): "
                      + ", ".join(f"{k} {v}" for k, v in spent.items()))
        for c in VARIANTS:
            if thr.get(f"{c}_over_alone") is not None:
                print(f"throughput {c} ({VARIANTS[c]}): {thr[c]['gen_tok_s']} gen tok/s "
                      f"({thr[f'{c}_over_alone']}x alone)")
    return summary


def _logprob_gap(want: dict[str, float] | None, got: dict[str, float] | None) -> float | None:
    """Largest |logprob difference| over the recompute's top tokens (a token missing from the
    hit's top list counts as its whole logprob): about 0.1 or less is bf16 noise between two
    batch shapes; a hit served from the wrong KV moves them by whole units."""
    if not want or not got:
        return None
    floor = min(got.values())
    return round(max(abs(lp - got.get(t, floor)) for t, lp in want.items()), 4)


def _ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 3) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b \
        else None
