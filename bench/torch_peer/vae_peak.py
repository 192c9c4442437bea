#!/usr/bin/env python3
"""The no-grad `vae.encode` peak of each family's VAE on the CPU, above its weights, per input
pixel (Wan: of one frame, for a 9-frame clip — its chunked encode stops growing with the
frames): the real diffusers classes at the published configs (as in
`count_frozen.py`), fp32 and bf16, at two sizes so that the per-pixel figure is seen to hold.
`crates/budget/src/families/frozen.rs` pins the per-pixel figures.

    bench/torch_peer/.venv/bin/python bench/torch_peer/vae_peak.py
"""

import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
from diffusers import AutoencoderKL, AutoencoderKLWan  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import measure  # noqa: E402
from frozen_models import KL, dcae_sana  # noqa: E402

torch.set_num_threads(2)

def main():
    cases = [
        ("SD VAE", lambda: AutoencoderKL(latent_channels=4, **KL), 1),
        ("SD3/Flux VAE", lambda: AutoencoderKL(latent_channels=16, use_quant_conv=False,
                                               use_post_quant_conv=False, **KL), 1),
        ("DC-AE f32c32", dcae_sana, 1),
        ("Wan-VAE", lambda: AutoencoderKLWan(), 9),
    ]
    for name, make, frames in cases:
        vae = make().eval()
        for dtype in (torch.float32, torch.bfloat16):
            v = vae.to(dtype)
            for side in ((64, 128) if frames > 1 else (128, 256)):
                shape = (1, 3, frames, side, side) if frames > 1 else (1, 3, side, side)
                x = torch.randn(shape, dtype=dtype)
                with torch.no_grad():
                    peak, _, _ = measure.cpu_step_peak(lambda: v.encode(x))
                px = side * side * frames
                row = {"vae": name, "dtype": str(dtype).split(".")[1], "side": side,
                       "frames": frames, "peak": peak, "bytes_per_pixel": peak / px,
                       "elems_per_pixel": peak / px / (4 if dtype == torch.float32 else 2)}
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
