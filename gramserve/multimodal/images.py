"""Reading the images of `image_url` content parts, within the operator's limits.

- `data:image/...;base64,...` URLs always.
- `file://` URLs (or plain paths) only under --allowed-local-media-path; http(s) URLs only from hosts of
  --allowed-media-domains ("*": any). Both are off by default: a request cannot make the server read its disk or
  open a connection unless the operator said so.
- Every image: at most --max-image-bytes encoded and --max-image-pixels decoded (checked before decoding the pixels,
  so a small file that decompresses into a huge image is refused cheaply); PNG, JPEG, WebP, GIF (first frame) or BMP.

Errors are ImageError (a 400, or 403 for a source the operator did not allow), with what was wrong.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
import urllib.parse
from dataclasses import dataclass

FORMATS = {"PNG", "JPEG", "WEBP", "GIF", "BMP"}


class ImageError(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int
    allowed_local_path: str | None = None
    allowed_domains: tuple[str, ...] = ()
    fetch_timeout: float = 10.0


def image_bytes(url: str, limits: ImageLimits) -> bytes:
    """The encoded image an image_url names (data: URL, allowed file or allowed host)."""
    return _image_bytes(url.strip(), limits)


def decode_image(data: bytes, limits: ImageLimits):
    """Encoded image bytes -> an RGB PIL image, within the pixel limit."""
    from PIL import Image

    if len(data) > limits.max_bytes:
        raise ImageError(f"image of {len(data)} bytes is larger than the limit ({limits.max_bytes} bytes)")
    Image.MAX_IMAGE_PIXELS = None  # our own limit below, with our own message
    try:
        image = Image.open(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001 - PIL raises several types for data it cannot read
        raise ImageError(f"the image could not be read ({type(exc).__name__}: {exc})") from None
    if image.format not in FORMATS:
        raise ImageError(f"image format {image.format} is not supported (send {', '.join(sorted(FORMATS))})")
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageError(f"image of {width}x{height} pixels is larger than the limit ({limits.max_pixels} pixels)")
    if width < 1 or height < 1:
        raise ImageError("the image is empty")
    try:
        image.seek(0)
        image.load()  # decode here: truncated pixel data fails inside this try, not later
        return to_rgb(image)
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt pixel data shows only when decoded
        raise ImageError(f"the image data is corrupt ({type(exc).__name__}: {exc})") from None


def to_rgb(image):
    """RGB, transparent pixels on white (as HF's `convert_to_rgb`; `convert("RGB")` made them black, so a transparent
    PNG's pixels differed from the reference processor's)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def _image_bytes(url: str, limits: ImageLimits) -> bytes:
    if url[:5].lower() == "data:":  # URL schemes are case-insensitive
        return _data_url(url, limits)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        return _fetch(url, limits)
    if scheme == "file" or scheme == "":
        return _local_file(url, limits)
    raise ImageError(f"image_url scheme {scheme!r} is not supported (data:, and http(s) / file when allowed)")


def _data_url(url: str, limits: ImageLimits) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ImageError("a data: image_url needs a comma before its data")
    mime = header[5:].split(";")[0].strip().lower()
    if mime and not mime.startswith("image/"):
        raise ImageError(f"a data: image_url must hold an image, not {mime!r}")
    if ";base64" not in header.lower():
        raise ImageError("a data: image_url must be base64 encoded (data:image/png;base64,...)")
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise ImageError(f"image larger than the limit ({limits.max_bytes} bytes)")
    # Line breaks (base64 wrapped at 76 columns) and the URL-safe alphabet are base64 too, as clients write it.
    payload = "".join(payload.split()).replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: image_url is not valid base64") from None


def _local_file(url: str, limits: ImageLimits) -> bytes:
    if limits.allowed_local_path is None:
        raise ImageError(
            "local image files are not allowed on this server (start it with --allowed-local-media-path DIR)", 403
        )
    path = urllib.parse.unquote(urllib.parse.urlsplit(url).path) if url.startswith("file:") else url
    root = os.path.realpath(limits.allowed_local_path)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise ImageError(f"image file {path!r} is outside the allowed folder", 403)
    try:
        if os.path.exists(real) and not os.path.isfile(real):  # a FIFO or a device would block a prep thread
            raise ImageError(f"image file {path!r} is not a regular file")
        if os.path.getsize(real) > limits.max_bytes:
            raise ImageError(f"image file larger than the limit ({limits.max_bytes} bytes)")
        with open(real, "rb") as f:
            return f.read(limits.max_bytes + 1)
    except OSError as exc:
        raise ImageError(f"image file {path!r} could not be read: {exc.strerror}") from None


def _fetch(url: str, limits: ImageLimits) -> bytes:
    import httpx

    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    allowed = limits.allowed_domains
    if not allowed:
        raise ImageError("image URLs are not fetched by this server (start it with --allowed-media-domains)", 403)
    if "*" not in allowed and host not in allowed:
        raise ImageError(f"image host {host!r} is not in the allowed domains", 403)
    # httpx's timeout bounds each read: a host sending a byte a second never trips it, so the whole fetch has a
    # deadline of its own (checked as the body arrives, in chunks of at most 16 KiB).
    deadline = time.monotonic() + limits.fetch_timeout
    try:
        with httpx.stream("GET", url, timeout=limits.fetch_timeout, follow_redirects=False) as resp:
            if resp.status_code != 200:
                raise ImageError(f"fetching the image gave HTTP {resp.status_code}")
            chunks, size = [], 0
            for chunk in resp.iter_bytes(16384):
                size += len(chunk)
                if size > limits.max_bytes:
                    raise ImageError(f"image larger than the limit ({limits.max_bytes} bytes)")
                if time.monotonic() > deadline:
                    raise ImageError(f"fetching the image took longer than {limits.fetch_timeout:g} s")
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as exc:
        raise ImageError(f"the image could not be fetched ({type(exc).__name__})") from None
