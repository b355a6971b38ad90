"""Images through the HTTP server: TTFT per image, images/s and TPOT of a LLaVA model, against text prompts of the
same length in the same run.

It writes a LLaVA-1.5-7B-shaped model folder (Llama-2-7B text model, CLIP ViT-L/14 at 336 px: 576 tokens per
image; the default tokenizer plus an `<image>` token; no weights: served with `--load-format dummy`), or takes
`--model-dir`, starts one server and runs, per concurrency c, `max(2c, --min-requests)` streamed chat requests at
most c in flight:

- *image*: a short question and one distinct random image (640 x 480 JPEG) each: vision tower + prefill;
- *same image*: all with one image (features and the prefix cache serve the repeats);
- *text of the same length*: a distinct first sentence, the question and as many text tokens as an image's
  placeholders (distinct prompts, as the distinct images are: the prefix cache serves neither).

Each with `--output-len` tokens (`ignore_eos`, greedy). Reported: mean TTFT, TPOT, images/s (requests with an image
over the run's wall time) and output tok/s.

    python benchmarks/bench_vlm.py --concurrencies 1 16 64 --server-args="--device cuda"
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import shlex
import sys
import tempfile
import time
from datetime import datetime, timezone

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import machine_info  # noqa: E402
from run_cpu_suite import Server, free_port  # noqa: E402

LLAMA2_7B = dict(
    model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
CLIP_L_336 = dict(
    model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
    num_attention_heads=16, image_size=336, patch_size=14, hidden_act="quick_gelu", layer_norm_eps=1e-5,
)  # fmt: skip


def write_model(out: str, tokenizer_dir: str) -> str:
    """A LLaVA-1.5-7B-shaped config.json and tokenizer (with `<image>`) in `out`; returns the config's path."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(["<image>"], special_tokens=True)
    tok.save_pretrained(out)
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": tok.convert_tokens_to_ids("<image>"),
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "projector_hidden_act": "gelu",
        "text_config": {**LLAMA2_7B, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id},
        "vision_config": CLIP_L_336,
    }
    path = os.path.join(out, "config.json")
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    return path


def jpeg_url(seed: int) -> str:
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(480, 640, 3) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


async def one(http: httpx.AsyncClient, url: str, content, output_len: int) -> dict:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    stamps = []
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    stamps.append(time.perf_counter())
    ttft = stamps[0] - t0
    tpot = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return {"ttft": ttft, "tpot": tpot, "tokens": len(stamps)}


async def run(url: str, contents: list, concurrency: int, output_len: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as http:

        async def limited(content):
            async with sem:
                return await one(http, url, content, output_len)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(c) for c in contents))
        wall = time.perf_counter() - t0
    n = len(results)
    return {
        "requests": n,
        "ttft_ms": 1e3 * sum(r["ttft"] for r in results) / n,
        "tpot_ms": 1e3 * sum(r["tpot"] for r in results) / n,
        "requests_per_s": n / wall,
        "output_tok_s": sum(r["tokens"] for r in results) / wall,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="a LLaVA folder to serve (default: write the 7B shape, dummy weights)")
    p.add_argument("--tokenizer", help="tokenizer to add <image> to (default: the default model's)")
    p.add_argument("--server-args", default="", help="more arguments for gramserve serve")
    p.add_argument("--concurrencies", type=int, nargs="+", default=[1, 16])
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--output-dir", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="bench-vlm-")
    if args.model_dir:
        server_args = ["--model", args.model_dir]
    else:
        from gramserve.model.loader import default_tokenizer_dir

        config = write_model(work, args.tokenizer or default_tokenizer_dir())
        server_args = ["--model", config, "--load-format", "dummy", "--tokenizer", work]
    server = Server(server_args + shlex.split(args.server_args), free_port(), os.path.join(work, "server.log"))
    server.start(timeout=1200)
    rows = []
    try:
        url = server.base_url
        question = {"type": "text", "text": "Extract every field of this document as JSON."}
        image_tokens = 576
        filler = " the" * image_tokens  # about one token each
        seed = 0
        for c in args.concurrencies:
            n = max(2 * c, args.min_requests)
            runs = {
                # distinct from its first token on, as distinct images are: no prefix-cache hits past the template
                "text of the same length": [
                    [{"type": "text", "text": f"Request {c}-{i}."}, question, {"type": "text", "text": filler}]
                    for i in range(n)
                ],
                "image": [],
                "same image": [[question, {"type": "image_url", "image_url": {"url": jpeg_url(99)}}]] * n,
            }
            for _ in range(n):
                seed += 1
                runs["image"].append([question, {"type": "image_url", "image_url": {"url": jpeg_url(seed)}}])
            asyncio.run(run(url, runs["image"][: min(n, 4)], c, 4))  # warm this batch size
            for name, contents in runs.items():
                out = asyncio.run(run(url, contents, c, args.output_len))
                row = {"concurrency": c, "run": name, **out}
                print(json.dumps(row), flush=True)
                rows.append(row)
        images = httpx.get(url + "/get_server_info", timeout=30).json().get("images")
    finally:
        server.stop()
    print("\n| c | run | TTFT ms | TPOT ms | requests/s | output tok/s |\n|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['concurrency']} | {r['run']} | {r['ttft_ms']:.1f} | {r['tpot_ms']:.2f} | "
            f"{r['requests_per_s']:.2f} | {r['output_tok_s']:.0f} |"
        )
    print(f"\nserver startup {server.startup_s:.0f} s; image counters {images}")
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        with open(os.path.join(args.output_dir, f"vlm-{stamp}.json"), "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "rows": rows, "images": images}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
