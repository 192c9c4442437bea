"""The table of an end-to-end run folder (`end_to_end.py`'s results.json): measured vs predicted.

Columns:
- measured: the largest peak of live CPU tensors over the steady steps (2 and later: step 1 also
  creates AdamW's state), from the interpreter's first allocation — so it holds everything the
  process keeps (every model, the dataset, the caches), as device memory would on CUDA except the
  dataset's images (DreamBoothDataset.pixel_values: host memory on CUDA), which are subtracted;
- predicted: `ditmem estimate --runtime pytorch:cpu` of the recipe the export launches, as printed
  (its frozen text encoders and VAE are the real checkpoints' — T5-XXL, CLIP, Gemma-2-2B, the
  16-channel VAE —, built into the budget; only the transformer follows `--config`);
- measured, in the encoders' runs / the rest: the step's peak inside the frozen encoders' runs
  (`ditmem::encode` ranges: VAE encode, text encoders' forward) and outside them (the
  transformer's forward, backward, optimizer step);
- predicted, the rest, tiny frozen parts: the estimate's peak over its transformer phases
  (every phase but `encode`) with the frozen parts it counts resident replaced by the tiny
  pipeline's measured bytes of those classes — like for like with the measured rest (the encode
  phases cannot be compared: the budget's encoder transients are the real encoders');
- error: predicted rest / measured rest − 1.

    python e2e_table.py RUN_DIR   # prints markdown; writes RUN_DIR/table.md
"""

import json
import os
import sys

MiB = 1024 * 1024


def fmt(b):
    return f"{b / MiB:,.2f} MiB"


def frozen_owner(owner):
    return any(k in owner for k in ("TextModel", "EncoderModel", "Gemma2Model", "Autoencoder")) \
        and "params+buffers" in owner


def summarise(row):
    m = row["measured"]
    steps = m["steps"]
    steady = steps[1:] or steps
    k = max(range(len(steady)), key=lambda i: steady[i]["peak"]) + (1 if len(steps) > 1 else 0)
    step = steps[k]
    owners = {o["owner"]: o for o in step["owners_at_start"]}
    host = owners.get("host: DreamBoothDataset pixel_values, prefetched next batch", {}).get("bytes", 0)
    measured = step["peak"] - host
    measured_train = step.get("peak_outside_encode", step["peak"]) - host
    measured_encode = max(step.get("peak_encode", 0) - host, 0)
    frozen_measured = {o: v["bytes"] for o, v in owners.items() if frozen_owner(o) and v["bytes"]}
    # What the budget counts resident, by class, and the tiny pipeline's bytes of that class.
    resident = [e for e in row["encoders"] if e["resident"]]
    tiny_resident = 0
    for e in resident:
        cls = e["class"].split(".")[-1]
        if "decoder" in e["name"]:
            continue  # the AutoencoderKL's bytes below are the whole VAE, decoder included
        tiny_resident += sum(b for o, b in frozen_measured.items() if o.startswith(cls + " "))
    phases = dict((p, b) for p, b in row.get("phase_peaks", []))
    if not phases:
        phases = {row["predicted_phase"]: row["predicted_peak"]}
    train_phase = max(b for p, b in phases.items() if p != "encode") if any(p != "encode" for p in phases) \
        else row["predicted_peak"]
    at_tiny = train_phase - row["static"]["encoder_weights"] + tiny_resident
    return {
        "case": row["case"], "script": row["script"], "step": k + 1, "measured": measured, "host": host,
        "predicted": row["predicted_peak"], "predicted_phase": row["predicted_phase"],
        "at_tiny": at_tiny, "error": at_tiny / measured_train - 1, "frozen_measured": frozen_measured,
        "measured_train": measured_train, "measured_encode": measured_encode,
        "owners": step["owners_at_start"], "steps": [(s["start"], s["peak"]) for s in steps],
    }


def main():
    d = sys.argv[1]
    rows = json.load(open(os.path.join(d, "results.json")))
    out = ["| script | recipe (the export's) | measured step peak | measured: in the encoders' runs / "
           "the rest | predicted (as printed) | predicted, the rest, tiny frozen parts | error (the rest) | "
           "steps (start → peak) |", "|---|---|---|---|---|---|---|---|"]
    detail = []
    for row in rows:
        if "measured" not in row:
            log = open(os.path.join(d, row["case"], "run.log"), errors="replace").read()
            err = [l for l in log.splitlines() if l.startswith("RuntimeError: ") and "^" not in l]
            out.append(f"| `{row.get('script', '')}` ({row['case']}) | {row.get('recipe_line', '')} | "
                       f"crashed: `{err[-1][:110] if err else 'see its run.log'}` | | {fmt(row['predicted_peak'])} | | | |")
            continue
        s = summarise(row)
        rec = row.get("recipe_line", "")
        out.append(
            f"| `{s['script']}` | {rec} | {fmt(s['measured'])} (step {s['step']}) | "
            f"{fmt(s['measured_encode']) if s['measured_encode'] else '—'} / {fmt(s['measured_train'])} | {fmt(s['predicted'])} "
            f"({s['predicted_phase']}) | {fmt(s['at_tiny'])} | {s['error']:+.1%} | "
            + "; ".join(f"{fmt(a)} → {fmt(b)}" for a, b in s["steps"]) + " |")
        detail.append(f"\n### {s['case']}: live tensors at the start of step {s['step']}\n")
        detail.append("| owner | bytes | dtypes |\n|---|---|---|")
        for o in s["owners"]:
            if o["bytes"]:
                detail.append(f"| {o['owner']} | {o['bytes']:,} | {', '.join(o['dtypes'])} |")
        detail.append(f"\nhost-only (subtracted): {s['host']:,} B; predicted breakdown at its peak: "
                      + ", ".join(f"{k} {v:,}" for k, v in row["predicted_breakdown"].items() if v))
    text = "\n".join(out + detail) + "\n"
    with open(os.path.join(d, "table.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
