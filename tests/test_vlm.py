"""Images through the chat API: a tiny LLaVA (random weights, the default tokenizer plus an `<image>` token) served
by a real server, spoken to with the openai SDK's image content parts.

Checked against HF transformers (its CLIP image processor, and LlavaForConditionalGeneration's greedy output for
the same prompt and pixels), plus the caches (prefix cache and vision features), structured outputs and tools over
an image, and the bad inputs: each a clear 400 / 403, the server unharmed.
"""

from __future__ import annotations

import base64
import io
import json
import os

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch
from conftest import start_server

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

TOKENS_PER_IMAGE = 16  # (56 / 14) ** 2


def make_tiny_llava(out: str) -> int:
    """A LLaVA checkpoint of random weights in `out` (HF format, with its tokenizer). Returns the image token id."""
    from transformers import AutoTokenizer, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from gramserve.model.loader import default_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(default_tokenizer_dir())
    tok.add_tokens(["<image>"], special_tokens=True)
    image_id = tok.convert_tokens_to_ids("<image>")
    text = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=56,
        patch_size=14, projection_dim=32,
    )  # fmt: skip
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # HF initialises biases to zero and norms to one: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return image_id


def picture(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype(np.uint8))


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    mime = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}[fmt]
    return f"data:{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    model_dir = str(root / "model")
    image_id = make_tiny_llava(model_dir)
    allowed = root / "allowed"
    allowed.mkdir()
    picture(64, 48, 7).save(allowed / "inside.png")
    picture(64, 48, 7).save(root / "outside.png")
    srv = start_server(
        str(root),
        "--model",
        model_dir,
        "--allowed-local-media-path",
        str(allowed),
        "--max-images-per-request",
        "3",
        "--max-image-pixels",
        "1000000",
        "--allowed-media-domains",
        "127.0.0.1",
        "--media-fetch-timeout",
        "2",
    )
    srv.model_dir, srv.image_id, srv.root = model_dir, image_id, root
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)


def test_image_processor_matches_hf_clip():
    from transformers import CLIPImageProcessor

    from gramserve.multimodal.processors import CLIP_MEAN, CLIP_STD, ClipImageProcessor

    ours = ClipImageProcessor(56, 56, CLIP_MEAN, CLIP_STD)
    ref = CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    for w, h in [(80, 60), (60, 80), (56, 56), (201, 300), (90, 37)]:
        image = picture(w, h, seed=w)
        want = ref(images=image, return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(ours.pixels(image), want, atol=1e-5)
    # Transparent pixels go on white, as HF's convert_to_rgb puts them (convert("RGB") made them black): a
    # half-transparent RGBA PNG and a palette PNG with a transparent index, through decode_image as served.
    from gramserve.multimodal.images import ImageLimits, decode_image

    rgba = np.asarray(picture(70, 60, seed=3)).copy()
    alpha = np.where(np.arange(70)[None, :] < 35, 0, 255).astype(np.uint8).repeat(60, 0)
    palette = Image.fromarray(np.asarray(picture(60, 70, seed=4))).convert("P")
    palette.info["transparency"] = 0
    for image in (Image.fromarray(np.dstack([rgba, alpha]), "RGBA"), palette):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        served = decode_image(buf.getvalue(), ImageLimits(max_bytes=10**7, max_pixels=10**7))
        want = ref(images=Image.open(io.BytesIO(buf.getvalue())), return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(ours.pixels(served), want, atol=1e-5)


def test_image_placeholders_differ_with_the_whole_digest():
    """Two images whose digests are equal modulo the vocabulary (digest + i made their runs equal, and the prefix
    cache gave one the other's KV) get different placeholder runs; one digest always the same run."""
    from gramserve.multimodal.processors import placeholder_ids

    vocab = 49153
    a, b = placeholder_ids(114, 16, vocab), placeholder_ids(114 + vocab, 16, vocab)
    assert a != b and a == placeholder_ids(114, 16, vocab)
    assert all(0 <= t < vocab for t in a + b)


@torch.inference_mode()
def test_chat_with_images_matches_hf(vlm):
    """Two images and text in one message: the same greedy text as HF's LlavaForConditionalGeneration.generate on
    the same prompt and pixels (the first in one turn, then both in a second message)."""
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    from gramserve.multimodal.processors import CLIP_MEAN, CLIP_STD, ClipImageProcessor

    images = [picture(80, 60, 1), picture(50, 90, 2)]
    content = [
        {"type": "text", "text": "Compare "},
        image_part(data_url(images[0])),
        {"type": "text", "text": " with "},
        image_part(data_url(images[1], "JPEG")),
    ]
    r = client(vlm).chat.completions.create(
        model="default", messages=[{"role": "user", "content": content}], max_tokens=10, temperature=0
    )
    got = r.choices[0].message.content
    assert r.usage.prompt_tokens > 2 * TOKENS_PER_IMAGE

    tok = AutoTokenizer.from_pretrained(vlm.model_dir)
    hf = LlavaForConditionalGeneration.from_pretrained(vlm.model_dir).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Compare <image> with <image>"}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    expanded = []
    for t in ids:
        expanded += [t] * TOKENS_PER_IMAGE if t == vlm.image_id else [t]
    assert len(expanded) == r.usage.prompt_tokens
    clip = ClipImageProcessor(56, 56, CLIP_MEAN, CLIP_STD)
    decoded = [Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",")[1]))) for p in content[1::2]]
    pixels = torch.from_numpy(np.stack([clip.pixels(im.convert("RGB")) for im in decoded]))
    out = hf.generate(input_ids=torch.tensor([expanded]), pixel_values=pixels, max_new_tokens=10, do_sample=False)
    assert got == tok.decode(out[0, len(expanded) :], skip_special_tokens=True)


def test_a_repeated_image_is_not_encoded_again(vlm):
    c = client(vlm)
    url = data_url(picture(70, 70, 3))

    def ask(text: str):
        msg = [{"role": "user", "content": [{"type": "text", "text": text}, image_part(url)]}]
        return c.chat.completions.create(model="default", messages=msg, max_tokens=3, temperature=0)

    def counters() -> dict:
        return httpx.get(vlm.base_url + "/get_server_info").json()["images"]

    first = ask("Describe this picture:")
    before = counters()
    again = ask("Describe this picture:")  # the prefix cache holds the image's KV
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content
    other = ask("What colour dominates here?")  # another text before it: the features come from their cache
    after = counters()
    assert other.usage.prompt_tokens_details.cached_tokens < other.usage.prompt_tokens - TOKENS_PER_IMAGE
    assert after["images_encoded"] == before["images_encoded"]
    assert after["image_cache_hits"] > before["image_cache_hits"]
    # a different image behind the same text is not served from the cache
    msg = [{"role": "user", "content": [{"type": "text", "text": "Describe this picture:"}]}]
    msg[0]["content"].append(image_part(data_url(picture(70, 70, 4))))
    diff = c.chat.completions.create(model="default", messages=msg, max_tokens=3, temperature=0)
    assert diff.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - TOKENS_PER_IMAGE + 1
    assert counters()["images_encoded"] == after["images_encoded"] + 1


RECEIPT = {
    "type": "object",
    "properties": {
        "merchant": {"type": "string", "maxLength": 30},
        "total": {"type": "number", "minimum": 0},
        "currency": {"enum": ["USD", "EUR", "GBP"]},
        "items": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 20}},
    },
    "required": ["merchant", "total", "currency"],
    "additionalProperties": False,
}


def test_structured_output_and_tools_over_an_image(vlm):
    c = client(vlm)
    content = [
        {"type": "text", "text": "Extract the fields of this receipt."},
        image_part(data_url(picture(90, 120, 5))),
    ]
    for seed in range(3):  # random weights at temperature 1: whatever path the grammar allows, the output is valid
        r = c.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": content}],
            response_format={"type": "json_schema", "json_schema": {"name": "receipt", "schema": RECEIPT}},
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(r.choices[0].message.content), RECEIPT)
    tool = {"type": "function", "function": {"name": "save_receipt", "parameters": RECEIPT}}
    r = c.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": content}],
        tools=[tool],
        tool_choice="required",
        max_tokens=200,
        temperature=1.0,
        seed=11,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "save_receipt"
    if r.choices[0].finish_reason == "tool_calls":
        jsonschema.validate(json.loads(calls[0].function.arguments), RECEIPT)


def test_streamed_and_local_file_images(vlm):
    c = client(vlm)
    inside = "file://" + os.path.join(vlm.root, "allowed", "inside.png")
    msg = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, image_part(inside)]}]
    stream = c.chat.completions.create(model="default", messages=msg, max_tokens=5, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    same = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, image_part(data_url(picture(64, 48, 7)))]}]
    whole = c.chat.completions.create(model="default", messages=same, max_tokens=5, temperature=0)
    assert text == whole.choices[0].message.content  # the file's pixels are the data URL's


def test_an_image_from_an_allowed_host(vlm):
    """--allowed-media-domains 127.0.0.1: the image is fetched, and reads as the same pixels sent as a data URL; a
    missing one is a clear error."""
    import http.server
    import threading

    image = picture(64, 48, 12)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    body = buf.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/receipt.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        c = client(vlm)

        def ask(url: str):
            msg = [{"role": "user", "content": [{"type": "text", "text": "Read:"}, image_part(url)]}]
            return c.chat.completions.create(model="default", messages=msg, max_tokens=5, temperature=0)

        fetched = ask(base + "/receipt.png").choices[0].message.content
        assert fetched == ask(data_url(image)).choices[0].message.content
        assert "HTTP 404" in _error(vlm, [{"type": "text", "text": "x"}, image_part(base + "/missing.png")], 400)
    finally:
        httpd.shutdown()


def _error(srv, content, status: int) -> str:
    body = {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


def _dripping_url() -> str:
    """A local HTTP server that sends a PNG header, then a byte every 0.5 s: each read is quick, the whole is not."""
    import http.server
    import threading
    import time

    class Drip(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                for _ in range(40):
                    self.wfile.write(b"\x89")
                    self.wfile.flush()
                    time.sleep(0.5)
            except OSError:
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/slow.png"


def test_bad_images_get_clear_errors(vlm):
    text = {"type": "text", "text": "What is this?"}
    b64 = base64.b64encode
    assert "base64" in _error(vlm, [text, image_part("data:image/png;base64,@@@not base64@@@")], 400)
    assert "could not be read" in _error(
        vlm, [text, image_part("data:image/png;base64," + b64(b"hello").decode())], 400
    )
    assert "must hold an image" in _error(vlm, [text, image_part("data:text/plain;base64,aGVsbG8=")], 400)
    png = data_url(picture(40, 40, 9))
    raw = base64.b64decode(png.split(",")[1])
    truncated = "data:image/png;base64," + b64(raw[: len(raw) // 2]).decode()  # the header whole, pixels cut
    assert "corrupt" in _error(vlm, [text, image_part(truncated)], 400)
    assert "pixels" in _error(vlm, [text, image_part(data_url(Image.new("RGB", (1200, 1000))))], 400)
    assert "not in the allowed domains" in _error(vlm, [text, image_part("http://localhost:1/x.png")], 403)
    assert "could not be fetched" in _error(vlm, [text, image_part("http://127.0.0.1:1/x.png")], 400)
    outside = "file://" + os.path.join(vlm.root, "outside.png")
    assert "outside the allowed folder" in _error(vlm, [text, image_part(outside)], 403)
    assert "could not be read" in _error(
        vlm, [text, image_part("file://" + os.path.join(vlm.root, "allowed", "no.png"))], 400
    )
    # Read as clients write them: an uppercase scheme, base64 wrapped at 76 columns, the URL-safe alphabet.
    wrapped = "DATA:image/png;base64," + "\n".join(png.split(",")[1][i : i + 76] for i in range(0, len(png), 76))
    urlsafe = "data:image/png;base64," + png.split(",")[1].replace("+", "-").replace("/", "_")
    for url in (wrapped, urlsafe):
        r = client(vlm).chat.completions.create(
            model="default", messages=[{"role": "user", "content": [text, image_part(url)]}], max_tokens=2
        )
        assert r.choices[0].finish_reason in ("stop", "length")
    fifo = os.path.join(vlm.root, "allowed", "pipe.png")
    os.mkfifo(fifo)  # opening it would block the prep thread until a writer came
    assert "not a regular file" in _error(vlm, [text, image_part("file://" + fifo)], 400)
    assert "longer than 2 s" in _error(vlm, [text, image_part(_dripping_url())], 400)  # was: as long as it drips
    assert "limit is 3" in _error(vlm, [text] + [image_part(png)] * 4, 400)
    assert "image tokens" in _error(vlm, [{"type": "text", "text": "a <image> typed in text"}], 400)
    assert "url" in _error(vlm, [text, {"type": "image_url", "image_url": {}}], 400)
    assert "detail" in _error(vlm, [text, {"type": "image_url", "image_url": {"url": png, "detail": "ultra"}}], 400)
    assert "not supported" in _error(vlm, [text, {"type": "input_audio", "input_audio": {"data": ""}}], 400)
    # the server is unharmed; OpenAI's details are read
    low = {"type": "image_url", "image_url": {"url": png, "detail": "low"}}
    r = client(vlm).chat.completions.create(
        model="default", messages=[{"role": "user", "content": [text, low]}], max_tokens=2
    )
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_text_model_refuses_images(base_url):
    content = [{"type": "text", "text": "What is this?"}, image_part(data_url(picture(20, 20, 1)))]
    body = {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]


def test_chunked_prefill_through_images(vlm, tmp_path):
    """Prompt chunks of 8 tokens cut through each image's 16 placeholders: the same output as one prefill. Also:
    the warm-up ran an image request."""
    assert "image " in [line for line in vlm.log().splitlines() if "warm-up done" in line][0]
    content = [
        {"type": "text", "text": "Compare "},
        image_part(data_url(picture(80, 60, 1))),
        {"type": "text", "text": " with "},
        image_part(data_url(picture(50, 90, 2))),
    ]
    msg = [{"role": "user", "content": content}]
    want = client(vlm).chat.completions.create(model="default", messages=msg, max_tokens=8, temperature=0)
    srv = start_server(str(tmp_path), "--model", vlm.model_dir, "--chunked-prefill-size", "8", "--skip-warmup")
    try:
        got = client(srv).chat.completions.create(model="default", messages=msg, max_tokens=8, temperature=0)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


LLAVA_15_TEMPLATE = (  # llava-hf/llava-1.5-7b-hf's: it reads content parts and writes the image tokens itself
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


@torch.inference_mode()
def test_a_template_that_reads_content_parts(vlm, tmp_path):
    """A LLaVA template iterates over content parts ({"type": "image"}): it gets them, and the prompt is the one
    HF's template gives (the greedy text equals HF's generate on it)."""
    import shutil

    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    from gramserve.multimodal.processors import CLIP_MEAN, CLIP_STD, ClipImageProcessor

    model_dir = str(tmp_path / "llava15")
    shutil.copytree(vlm.model_dir, model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = LLAVA_15_TEMPLATE
    tok.save_pretrained(model_dir)
    if os.path.exists(os.path.join(model_dir, "chat_template.jinja")):
        with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
            f.write(LLAVA_15_TEMPLATE)
    image = picture(60, 80, 21)
    srv = start_server(str(tmp_path), "--model", model_dir, "--skip-warmup")
    try:
        msg = [{"role": "user", "content": [{"type": "text", "text": "What is shown?"}, image_part(data_url(image))]}]
        r = client(srv).chat.completions.create(model="default", messages=msg, max_tokens=8, temperature=0)
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is shown?"}, {"type": "image"}]}]
    text = tok.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
    assert text.startswith("USER: <image>\nWhat is shown?")
    ids = []
    for t in tok.encode(text, add_special_tokens=False):
        ids += [t] * TOKENS_PER_IMAGE if t == vlm.image_id else [t]
    assert r.usage.prompt_tokens == len(ids)
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    pixels = torch.from_numpy(ClipImageProcessor(56, 56, CLIP_MEAN, CLIP_STD).pixels(image))[None]
    out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=8, do_sample=False)
    assert r.choices[0].message.content == tok.decode(out[0, len(ids) :], skip_special_tokens=True)
