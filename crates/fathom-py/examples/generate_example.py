"""The README's generation example on a randomly initialised Qwen3-style model (no hub weights
are needed, so it runs anywhere torch and transformers are, the device included), next to the
model's own dense `generate` for the same prompt.

    python crates/fathom-py/examples/generate_example.py --device cuda --json out.json

Every output names the model as random: its tokens say nothing about quality, only whether
each method reproduces the model's own greedy decode. `dense` and `exact` with a k past the
sequence must give the model's own tokens; `fathom:48` and a small-k `exact` may diverge, and
the output says at which step. Random weights attend almost uniformly (no key stands out), so
a top-k that keeps a quarter of the keys drops a large part of the attention mass and greedy
decoding leaves the dense path within a few steps; on trained models the mass concentrates
(the fidelity and downstream results in results/).
"""

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import transformers

import fathom
import fathom.hf
from fathom.capture import capture_model


def random_qwen3(seed: int) -> transformers.PreTrainedModel:
    """A 4-layer Qwen3-style model (QK-norm, GQA 8/2, D = 64), random weights."""
    torch.manual_seed(seed)
    c = transformers.Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512,
                                 num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                 head_dim=64, max_position_embeddings=8192,
                                 initializer_range=0.1)  # larger than the default 0.02, so greedy
    # decoding of random weights does not collapse into one repeated token
    return transformers.Qwen3ForCausalLM(c).eval()


def first_divergence(got: torch.Tensor, want: torch.Tensor, prompt: int):
    """The first generated step at which `got` leaves `want`, or None."""
    diff = (got[0, prompt:] != want[0, prompt:]).nonzero()
    return None if diff.numel() == 0 else int(diff[0, 0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="example: python generate_example.py --device cuda --json out.json")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where Fathom's cache lives (default: cuda when torch sees a GPU)")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens (random ids)")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per method")
    ap.add_argument("--k", type=int, default=256, help="top-k per query head of the sparse methods")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the result document here")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no GPU", file=sys.stderr)
        return 2
    model = random_qwen3(a.seed).to(a.device)
    g = torch.Generator().manual_seed(a.seed + 1)
    ids = torch.randint(0, 512, (1, a.prompt), generator=g).to(a.device)
    with tempfile.TemporaryDirectory() as tmp:
        # A calibration capture of the same model (the README's first three lines).
        cal_ids = torch.randint(0, 512, (1, 512), generator=g).to(a.device)
        layers, positions, meta = capture_model(model, cal_ids, 64)
        cap, cal = os.path.join(tmp, "cal.safetensors"), os.path.join(tmp, "cal.json")
        fathom.write_capture(cap, layers, positions, "qwen3-random", qk_norm=meta["qk_norm"],
                             layer_kinds=meta["layer_kinds"])
        fathom.calibrate(cap, cal, targets=[48.0], k=64)
        t0 = time.perf_counter()
        with torch.no_grad():
            want = model.generate(ids, max_new_tokens=a.new_tokens, do_sample=False, use_cache=True)
        runs = [{"method": "hf-dense (the model's own generate)", "tokens": want[0, a.prompt:].tolist(),
                 "seconds": time.perf_counter() - t0}]
        capacity = a.prompt + a.new_tokens
        for method, k, calib in [("dense", a.k, None), ("exact", capacity, None), ("exact", a.k, None),
                                 ("fathom:48", a.k, cal)]:
            t0 = time.perf_counter()
            got, att = fathom.hf.generate(model, ids, method, k=k, calib=calib, max_new_tokens=a.new_tokens,
                                          device=a.device)
            runs.append({"method": method, "k": k, "tokens": got[0, a.prompt:].tolist(),
                         "seconds": time.perf_counter() - t0,
                         "same_as_hf": bool(torch.equal(got.cpu(), want.cpu())),
                         "first_divergence": first_divergence(got.cpu(), want.cpu(), a.prompt),
                         "mean_bits": att.mean_bits, "density": att.density})
    doc = {"kind": "fathom-py-generate-example", "model": "qwen3-random (4 layers, random weights)",
           "device": a.device, "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
           "torch": torch.__version__, "transformers": transformers.__version__, "fathom": fathom.__version__,
           "prompt": a.prompt, "new_tokens": a.new_tokens, "runs": runs}
    print(f"random Qwen3-style model, {a.prompt}-token random prompt, {a.new_tokens} greedy tokens, "
          f"cache on {a.device}")
    for r in runs:
        same = "" if "same_as_hf" not in r else (
            "  = the model's own tokens" if r["same_as_hf"] else f"  diverges at step {r['first_divergence']}")
        bits = f"  bits {r['mean_bits']:.1f}  density {r['density']:.3f}" if "mean_bits" in r else ""
        k = f" k={r['k']}" if "k" in r else ""
        print(f"  {r['method']}{k}: {r['tokens'][:12]}…{same}{bits}")
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
