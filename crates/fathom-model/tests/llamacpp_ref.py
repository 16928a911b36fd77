"""Reference greedy decoding with llama.cpp (PyPI wheel `xllamacpp`) for tests/parity.rs.

usage: python3 llamacpp_ref.py MODEL.gguf REQUEST.json
REQUEST: {"n_predict": N, "n_ctx": C, "prompts": [{"ids": [...], "text": "..."}]}
Prints one JSON object: {"results": [{"ids": {...}, "text": {...}}]} where each run has
"prompt_tokens", "steps": [{"id": i, "top": [[id, logprob], ...5]}].
Exit code 3 (and a message on stderr) when xllamacpp is not installed.
"""
import json
import sys

try:
    import xllamacpp as xl
except Exception as e:  # noqa: BLE001
    print(f"xllamacpp not importable: {e}", file=sys.stderr)
    sys.exit(3)


def run(server, prompt, n_predict):
    r = server.handle_completions({
        "prompt": prompt, "n_predict": n_predict, "temperature": 0, "top_k": 1,
        "n_probs": 5, "cache_prompt": False, "ignore_eos": True,
    })
    if "choices" not in r:
        raise RuntimeError(f"llama.cpp error: {r}")
    steps = [{"id": t["id"], "top": [[x["id"], x["logprob"]] for x in t["top_logprobs"]]}
             for t in r["choices"][0]["logprobs"]["content"]]
    return {"prompt_tokens": r["usage"]["prompt_tokens"], "steps": steps}


def main():
    model, req = sys.argv[1], json.load(open(sys.argv[2]))
    p = xl.CommonParams()
    p.model.path = model
    p.n_ctx = req["n_ctx"]
    p.n_batch = 512
    p.n_ubatch = 512
    p.cpuparams.n_threads = 2
    p.cpuparams_batch.n_threads = 2
    p.warmup = False
    # f32 KV cache and no flash attention: llama.cpp's most exact CPU path (its defaults, an f16
    # cache and auto flash attention, add noise of their own).
    p.cache_type_k = xl.ggml_type.GGML_TYPE_F32
    p.cache_type_v = xl.ggml_type.GGML_TYPE_F32
    p.flash_attn_type = xl.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
    s = xl.Server(p)
    out = []
    for pr in req["prompts"]:
        res = {"ids": run(s, pr["ids"], req["n_predict"])}
        if pr.get("text") is not None:
            res["text"] = run(s, pr["text"], req["n_predict"])
        out.append(res)
    print(json.dumps({"results": out}))


main()
