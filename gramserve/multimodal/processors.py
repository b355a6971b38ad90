"""Image processors, keyed by model architecture: an image -> the pixel array its vision tower takes, and the prompt's
image tokens -> placeholder ranges.

The chat layer writes one image token (the tokenizer's `<image>`) where each image part was; `expand` widens each
to the image's `tokens_per_image` placeholders. Placeholder ids are drawn from the image's digest (`placeholder_ids`),
so the prefix cache tells two images apart, and reuses the KV of a repeated one; the model replaces their
embeddings with the image's features anyway.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from gramserve.messages import ImageInput
from gramserve.model.model_config import ModelConfig
from gramserve.multimodal.images import ImageError, ImageLimits, decode_image, image_bytes

RECENT_IMAGES = 64  # processed images kept by their bytes' hash in the main process
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ClipImageProcessor:
    """CLIP's preprocessing (LLaVA-1.5): resize the shortest edge (bicubic), center crop, scale to [0, 1],
    normalise. Settings from the model folder's preprocessor_config.json when it has one."""

    shortest_edge: int
    crop: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale: float = 1 / 255

    @classmethod
    def for_model(cls, cfg: ModelConfig, model_dir: str | None) -> "ClipImageProcessor":
        size = cfg.vision.image_size
        settings = {}
        path = os.path.join(model_dir, "preprocessor_config.json") if model_dir else None
        if path and os.path.exists(path):
            with open(path) as f:
                settings = json.load(f)
        edge = settings.get("size", {})
        crop = settings.get("crop_size", {})
        return cls(
            shortest_edge=edge.get("shortest_edge", size) if isinstance(edge, dict) else int(edge),
            crop=crop.get("height", size) if isinstance(crop, dict) else int(crop or size),
            mean=tuple(settings.get("image_mean", CLIP_MEAN)),
            std=tuple(settings.get("image_std", CLIP_STD)),
            rescale=float(settings.get("rescale_factor", 1 / 255)),
        )

    def pixels(self, image) -> np.ndarray:
        """An RGB PIL image -> float32 [3, crop, crop], normalised (what HF's CLIPImageProcessor gives)."""
        return normalize(self.resized(image), self.rescale, self.mean, self.std)

    def resized(self, image) -> np.ndarray:
        """An RGB PIL image -> uint8 [crop, crop, 3]: resized and cropped, not yet normalised."""
        from PIL import Image

        w, h = image.size
        # the short side to shortest_edge, the long one scaled and truncated (as HF's CLIPImageProcessor does)
        if w <= h:
            size = (self.shortest_edge, int(self.shortest_edge * h / w))
        else:
            size = (int(self.shortest_edge * w / h), self.shortest_edge)
        image = image.resize(size, Image.Resampling.BICUBIC)
        left, top = (size[0] - self.crop) // 2, (size[1] - self.crop) // 2
        image = image.crop((left, top, left + self.crop, top + self.crop))
        return np.asarray(image, dtype=np.uint8)

    @property
    def normalization(self) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
        return (self.rescale, self.mean, self.std)


def normalize(pixels: np.ndarray, rescale: float, mean, std) -> np.ndarray:
    """uint8 [S, S, 3] -> float32 [3, S, S]: (pixels * rescale - mean) / std per channel."""
    array = pixels.astype(np.float32) * rescale
    array = (array - np.array(mean, dtype=np.float32)) / np.array(std, dtype=np.float32)
    return np.ascontiguousarray(array.transpose(2, 0, 1))


class ImageProcessor:
    """What the chat layer needs of a vision-language model: its image token and how to process images."""

    def __init__(self, cfg: ModelConfig, model_dir: str | None, image_token: str, vocab_size: int):
        self.cfg = cfg.vision
        self.image_token = image_token  # the text the chat layer writes for each image part
        self.image_token_id = cfg.vision.image_token_id
        self.tokens_per_image = cfg.vision.tokens_per_image
        self.vocab_size = vocab_size
        self.pixel_processor = PIXEL_PROCESSORS[cfg.architecture].for_model(cfg, model_dir)
        self._recent: OrderedDict[bytes, tuple[np.ndarray, int]] = OrderedDict()
        self._lock = threading.Lock()  # load runs on the prep threads

    def load(self, url: str, limits: ImageLimits) -> tuple[np.ndarray, int]:
        """An image_url -> (uint8 pixels [S, S, 3], digest). The last images' results are kept by their encoded
        bytes' hash: a repeated image is not decoded and resized again."""
        data = image_bytes(url, limits)
        key = hashlib.sha256(data).digest()
        with self._lock:
            hit = self._recent.get(key)
            if hit is not None:
                self._recent.move_to_end(key)
                return hit
        pixels = self.pixel_processor.resized(decode_image(data, limits))
        digest = int.from_bytes(hashlib.sha256(pixels.tobytes()).digest()[:8], "little")
        with self._lock:
            self._recent[key] = (pixels, digest)
            while len(self._recent) > RECENT_IMAGES:
                self._recent.popitem(last=False)
        return pixels, digest

    def expand(self, input_ids: list[int], images: list) -> tuple[list[int], tuple[ImageInput, ...]]:
        """input_ids with each image token widened to its image's placeholders, and the images' inputs. `images`:
        PIL images, or (pixels, digest) pairs from `load`."""
        positions = [i for i, t in enumerate(input_ids) if t == self.image_token_id]
        if len(positions) != len(images):
            raise ImageError(
                f"the prompt holds {len(positions)} image tokens for {len(images)} images "
                f"(is {self.image_token!r} written in a text part?)"
            )
        out: list[int] = []
        inputs = []
        last = 0
        norm = self.pixel_processor.normalization
        for pos, image in zip(positions, images):
            if isinstance(image, tuple):
                pixels, digest = image
            else:
                pixels = self.pixel_processor.resized(image)
                digest = int.from_bytes(hashlib.sha256(pixels.tobytes()).digest()[:8], "little")
            out += input_ids[last:pos]
            inputs.append(ImageInput(pixels, digest, len(out), self.tokens_per_image, norm))
            out += placeholder_ids(digest, self.tokens_per_image, self.vocab_size)
            last = pos + 1
        out += input_ids[last:]
        return out, tuple(inputs)


def placeholder_ids(digest: int, count: int, vocab_size: int) -> list[int]:
    """An image's placeholder ids: `count` ids drawn from a generator seeded with its whole 64-bit digest, so two
    images share a prefix-cache run only if their digests do. (`digest + i` made the run depend on `digest % V`
    alone: one pair in about 200 images behind one prompt collided, and the second reused the first's KV.)"""
    return np.random.default_rng(digest).integers(0, vocab_size, size=count).tolist()


# The registry: each vision-language architecture's pixel preprocessing.
PIXEL_PROCESSORS = {"LlavaForConditionalGeneration": ClipImageProcessor}


def image_processor(cfg: ModelConfig, model_dir: str | None, tokenizer, vocab_size: int) -> ImageProcessor | None:
    """The processor of a vision-language model (None for a text model)."""
    if cfg.vision is None:
        return None
    if cfg.architecture not in PIXEL_PROCESSORS:
        raise ValueError(f"no image processor for {cfg.architecture}")
    token = tokenizer.convert_ids_to_tokens(cfg.vision.image_token_id)
    if not isinstance(token, str):
        raise ValueError(f"the tokenizer has no image token (id {cfg.vision.image_token_id})")
    return ImageProcessor(cfg, model_dir, token, vocab_size)
