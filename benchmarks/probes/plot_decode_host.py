"""Bar chart of decode_host results: tok/s of each engine setting, for the runs with the core in its own process
and the GPU to itself (a run timed beside another engine says so: `beside_another_engine`).
Usage: python -m benchmarks.probes.plot_decode_host RESULTS_JSON OUT_PNG
(RESULTS_JSON: a document with `runs`, each a decode_host output, as results/decode_host_gpu.json)."""
import json


def bars(doc: dict) -> list[tuple[str, float]]:
    """(label, tok/s) of the runs with the core in its own process (as AsyncLLM runs it) and the whole GPU."""
    out = []
    for run in doc["runs"]:
        if run.get("core_in_process", True) or run.get("beside_another_engine"):
            continue
        for r in run["runs"]:
            label = ("rank-1 LoRA" if run["lora"] else "base model") + (
                ", no logprobs" if r["logprobs"] == "none" else f", logprobs={r['logprobs']}") + (
                f", {r['in_flight']} in flight" if r.get("in_flight", run["n"]) != run["n"] else "")
            out.append((label, float(r["tok_s"])))
    return out


def main(src: str, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.load(open(src))
    rows = bars(doc)
    fig, ax = plt.subplots(figsize=(8, 4))
    b = ax.barh([r[0] for r in rows], [r[1] / 1000 for r in rows], color="#27a")
    ax.bar_label(b, labels=[f"{r[1] / 1000:.1f}k" for r in rows], padding=3)
    ax.set_xlabel("tokens/s decoded, 384 sequences in flight, 1,024 new tokens each")
    ax.set_title(f"One vLLM engine alone: {doc.get('device', '')}", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(r[1] for r in rows) / 1000 * 1.2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("Usage:")[0])
    ap.add_argument("results_json")
    ap.add_argument("out_png")
    a = ap.parse_args()
    main(a.results_json, a.out_png)
