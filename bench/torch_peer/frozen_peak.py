#!/usr/bin/env python3
"""The no-grad forward peak of each frozen text encoder, above its weights, on the CPU: tiny
configs of the transformers classes the training scripts load (T5EncoderModel, UMT5EncoderModel,
CLIPTextModel(WithProjection), Gemma2Model), at the default attention implementation of the
installed transformers, in fp32 and bf16 (the scripts' `weight_dtype`). The rule in
`crates/budget/src/families/frozen.rs` is held against these numbers
(`crates/budget/tests/frozen_encoders.rs` pins them).

    bench/torch_peer/.venv/bin/python bench/torch_peer/frozen_peak.py [--json]
"""

import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import measure  # noqa: E402
import frozen_models as fm  # noqa: E402

torch.set_num_threads(2)


CASES = [
    ("t5", lambda: fm.t5(fm.T5EncoderModel, fm.T5Config, vocab=1000, d=64, ff=160, heads=4, dkv=16, layers=2)),
    ("umt5", lambda: fm.t5(fm.UMT5EncoderModel, fm.UMT5Config, vocab=1000, d=64, ff=160, heads=4, dkv=16, layers=2)),
    ("clip", lambda: fm.clip(fm.CLIPTextModel, vocab=1000, d=64, inter=256, heads=4, layers=2)),
    ("clip-proj", lambda: fm.clip(fm.CLIPTextModelWithProjection, vocab=1000, d=64, inter=256, heads=4, layers=2)),
    ("gemma2", lambda: fm.gemma(vocab=1000, d=64, inter=256, heads=4, kv=2, hd=16, layers=2)),
    # Layers as wide as the real encoders' (T5-XXL's heads of 64, CLIP-L, half of Gemma-2-2B),
    # two of them: the per-layer terms dominate here as they do at full size.
    ("t5-wide", lambda: fm.t5(fm.T5EncoderModel, fm.T5Config, vocab=1000, d=1024, ff=2560, heads=16, dkv=64, layers=2)),
    ("clip-wide", lambda: fm.clip(fm.CLIPTextModel, vocab=1000, d=768, inter=3072, heads=12, layers=2)),
    ("gemma2-wide", lambda: fm.gemma(vocab=1000, d=1152, inter=4608, heads=8, kv=4, hd=128, layers=2)),
]
SHAPES = {"t5-wide": ((1, 256), (2, 120)), "clip-wide": ((1, 77), (4, 77)),
          "gemma2-wide": ((1, 300), (2, 120))}


def main():
    rows = []
    for name, make in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            for batch, tokens in SHAPES.get(name, ((1, 77), (2, 64), (3, 40))):
                m = make().to(dtype).eval()
                ids = torch.randint(0, 1000, (batch, tokens))
                with torch.no_grad():
                    m(ids)  # warm-up
                    torch.manual_seed(0)

                    def step():
                        out = m(ids)
                        return out

                    peak, _, _ = measure.cpu_step_peak(step)
                rows.append({"arch": name, "dtype": str(dtype).split(".")[1], "batch": batch,
                             "tokens": tokens, "peak_above_weights": peak,
                             "attn": getattr(m.config, "_attn_implementation", None)})
                print(json.dumps(rows[-1]), flush=True)
    if "--json" in sys.argv:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
