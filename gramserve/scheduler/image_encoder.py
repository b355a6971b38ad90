"""The vision features of prefilling requests' images: computed by the model's vision tower when a prompt chunk
first reaches an image, and kept by image digest (LRU), so a repeated image is not encoded again even when the
prefix cache cannot serve it (another text before it)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from gramserve.messages import ImageInput
from gramserve.scheduler.request import Req


class ImageEncoder:
    def __init__(self, model, device: torch.device, capacity: int = 64):
        self.model = model  # has encode_images(pixels [N, C, S, S]) -> [N, tokens, hidden]
        self.device = device
        self.capacity = capacity
        self.cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.counters = {"images_encoded": 0, "image_cache_hits": 0}
        self._norm: tuple[torch.Tensor, torch.Tensor] | None = None  # mean and std on the device

    def embeds(self, picked: list[tuple[Req, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """ForwardBatch.input_embeds of a prefill batch: (rows of its new tokens, their features), for the image
        placeholders among each request's next `n` tokens (from its kv_len on). None: no image in the batch."""
        spans = []  # (image, batch row of its first placeholder in this chunk, its first placeholder index, count)
        row = 0
        for req, n in picked:
            start = req.kv_len
            for image in req.images:
                lo, hi = max(start, image.offset), min(start + n, image.offset + image.length)
                if lo < hi:
                    spans.append((image, row + lo - start, lo - image.offset, hi - lo))
            row += n
        if not spans:
            return None
        features = self._features([image for image, *_ in spans])
        rows = torch.cat([torch.arange(r, r + count) for _, r, _, count in spans])
        embeds = torch.cat([features[image.digest][first : first + count] for image, _, first, count in spans])
        return rows.to(self.device, non_blocking=True), embeds

    def _features(self, images: list[ImageInput]) -> dict[int, torch.Tensor]:
        out, missing = {}, {}
        for image in images:
            cached = self.cache.get(image.digest)
            if cached is not None:
                self.cache.move_to_end(image.digest)
                out[image.digest] = cached
                self.counters["image_cache_hits"] += 1
            else:
                missing[image.digest] = image
        if missing:
            encoded = self.model.encode_images(self._normalized(list(missing.values())))
            for digest, features in zip(missing, encoded):
                out[digest] = self.cache[digest] = features
                self.counters["images_encoded"] += 1
            while len(self.cache) > self.capacity:
                self.cache.popitem(last=False)
        return out

    def _normalized(self, images: list[ImageInput]) -> torch.Tensor:
        """uint8 [S, S, C] pixels -> the tower's float input [N, C, S, S], normalised on the device."""
        pixels = torch.from_numpy(np.stack([image.pixels for image in images]))
        if self.device.type == "cuda":  # pinned: the copy does not wait for the kernels queued before it (overlap)
            pixels = pixels.pin_memory()
        pixels = pixels.to(self.device, non_blocking=True)
        rescale, mean, std = images[0].normalization  # one model, one processor: the same for all
        if self._norm is None:
            self._norm = (torch.tensor(mean, device=self.device), torch.tensor(std, device=self.device))
        x = (pixels.float() * rescale - self._norm[0]) / self._norm[1]
        return x.permute(0, 3, 1, 2).contiguous()
