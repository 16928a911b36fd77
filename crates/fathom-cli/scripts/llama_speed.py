#!/usr/bin/env python3
"""llama.cpp's prefill and decode speed on the same token ids, for `fathom speed`.

Usage: llama_speed.py MODEL.gguf REQUEST.json
REQUEST: {"ids": [int], "n_predict": int, "n_ctx": int, "threads": int}
Prints one JSON line: prefill_tok_s, prefill_s, prompt_tokens, decode_tok_s, decode_steps.
Exit 3: xllamacpp is not importable; 4: llama.cpp returned no timings.
`fathom speed` embeds this file and runs it with `python3 -c`.
"""
import json, sys
try:
    import xllamacpp as xl
except Exception as e:
    print(f"xllamacpp is not importable: {e}", file=sys.stderr); sys.exit(3)
req = json.load(open(sys.argv[2]))
p = xl.CommonParams(); p.model.path = sys.argv[1]; p.n_ctx = req["n_ctx"]
p.n_batch = 512; p.n_ubatch = 512; p.warmup = False
p.cpuparams.n_threads = req["threads"]; p.cpuparams_batch.n_threads = req["threads"]
s = xl.Server(p)
r = s.handle_completions({"prompt": req["ids"], "n_predict": req["n_predict"], "temperature": 0,
                          "ignore_eos": True, "cache_prompt": False})
t = r.get("timings")
if not t:
    print(f"llama.cpp returned no timings: {r.get('error')}", file=sys.stderr); sys.exit(4)
print(json.dumps({"prefill_tok_s": t["prompt_per_second"], "prefill_s": t["prompt_ms"] / 1e3,
                  "prompt_tokens": t["prompt_n"], "decode_tok_s": t["predicted_per_second"],
                  "decode_steps": t["predicted_n"]}))
