"""Images in a prompt: where their tokens go and what the scheduler must know of them. No JAX.

A vision model's prompt marks each image with its begin-of-image token (Gemma 3:
`<start_of_image>`, which its chat template writes for an image part). The door expands every
mark into the image's token run

    ... "\\n\\n" <boi> <image> x N <eoi> "\\n\\n" ...

(`expand`: the N image tokens are the image's soft tokens: their embeddings come from the
vision encoder, not the embedding table). A prompt given as text gets the "\\n\\n" around each
mark as the model's processor writes them (`mark_text`); a prompt of ids gets the run at each
<boi> id (ids already expanded are kept as they are). The number of marks must equal the
number of images.

`ImageSpan(start, length, key, pixels)`: one image's token run in the prompt: its first image
token's position, N, the content digest (the prefix cache and the encoder cache key on it) and
the preprocessed pixels the encoder takes. The scheduler never splits a span between two
prefill chunks (its tokens attend to each other both ways: runtime/host/scheduler.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxinfer.runtime.host.errors import RequestError


@dataclass(frozen=True)
class ImageSpec:
    """What the door needs of a vision model: its image tokens and the encoder's input."""

    boi_id: int
    eoi_id: int
    image_id: int
    tokens_per_image: int
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    mark: str = "<start_of_image>"  # the text a prompt marks an image with


@dataclass(frozen=True, eq=False)
class ImageSpan:
    start: int  # position of its first image token
    length: int  # image tokens
    key: bytes  # content digest
    pixels: np.ndarray = field(repr=False)  # f32 [S, S, 3], normalized

    @property
    def end(self) -> int:
        return self.start + self.length


def mark_text(text: str, spec: ImageSpec) -> str:
    """A text prompt with the blank lines the model's processor writes around each image
    mark (tokenized with the rest; the mark itself encodes to <boi>)."""
    return text.replace(spec.mark, f"\n\n{spec.mark}\n\n")


def expand(ids: Sequence[int], images: Sequence[tuple[bytes, np.ndarray]], spec: ImageSpec,
           name: str = "prompt") -> tuple[list[int], tuple[ImageSpan, ...]]:
    """ids with each image mark (<boi>) expanded to the image's token run, and the spans;
    `images` [(digest, pixels)] in prompt order. A mark followed by <image> tokens is taken as
    expanded already (it must hold exactly N of them, then <eoi>)."""
    n = spec.tokens_per_image
    out: list[int] = []
    spans: list[ImageSpan] = []
    i = 0
    while i < len(ids):
        t = ids[i]
        i += 1
        if t == spec.image_id:
            raise RequestError(name, f"image token {t} outside an image run (<boi> + {n} image "
                                     "tokens + <eoi>)")
        out.append(t)
        if t != spec.boi_id:
            continue
        if len(spans) == len(images):
            raise RequestError(name, f"has more image marks ({spec.mark!r}) than the "
                                     f"{len(images)} image(s) given")
        if i < len(ids) and ids[i] == spec.image_id:  # expanded already
            run = ids[i:i + n]
            if len(run) < n or any(x != spec.image_id for x in run) or (
                    i + n < len(ids) and ids[i + n] == spec.image_id):
                raise RequestError(name, f"an image run must hold exactly {n} image tokens")
            i += n
            if i >= len(ids) or ids[i] != spec.eoi_id:
                raise RequestError(name, "an image run must end with <eoi>")
            i += 1
        key, pixels = images[len(spans)]
        spans.append(ImageSpan(len(out), n, key, pixels))
        out += [spec.image_id] * n + [spec.eoi_id]
    if len(spans) != len(images):
        raise RequestError("multi_modal_data.image" if name == "prompt" else name,
                           f"{len(images)} image(s) given but the prompt marks {len(spans)} "
                           f"(write {spec.mark!r} where each goes, or use the chat API)")
    return out, tuple(spans)


def span_hash_extras(spans: Sequence[ImageSpan], page_size: int, first_page: int,
                     n_pages: int) -> list[bytes]:
    """Per page first_page .. first_page + n_pages - 1: the digests (and offsets) of the images
    whose tokens it holds, mixed into its prefix hash (the image tokens' ids are all alike)."""
    out = []
    for j in range(first_page, first_page + n_pages):
        lo, hi = j * page_size, (j + 1) * page_size
        parts = [s.key + int(s.start - lo).to_bytes(8, "little", signed=True)
                 for s in spans if s.start < hi and s.end > lo]
        out.append(b"".join(parts))
    return out


def chunk_end(spans: Sequence[ImageSpan], start: int, n: int) -> int:
    """Tokens to compute from `start` (at most n) so that the chunk does not end inside an
    image run: cut back to the run's start, or 0 when the chunk starts in the run and cannot
    hold the rest of it."""
    end = start + n
    for s in spans:
        if s.start < end < s.end:
            return max(0, s.start - start) if s.start > start else 0
    return n


def decode_images(value, spec: ImageSpec, max_pixels: int, name: str = "multi_modal_data.image"
                  ) -> list[tuple[bytes, np.ndarray]]:
    """An image or a list of them (PIL images, numpy arrays, bytes, data URLs / base64) ->
    [(digest, pixels f32 [S, S, 3])], each checked at runtime/host/images.py's door."""
    from jaxinfer.runtime.host.images import image_digest, load_image, pixel_values

    items = list(value) if isinstance(value, (list, tuple)) else [value]
    out = []
    for i, v in enumerate(items):
        field_name = f"{name}[{i}]" if isinstance(value, (list, tuple)) else name
        img = load_image(v, field_name, max_pixels=max_pixels)
        out.append((image_digest(img), pixel_values(img, spec.image_size, spec.mean, spec.std)))
    return out


def parse_multimodal(prompt: dict, tokenizer, spec: ImageSpec | None, max_pixels: int,
                     parse_prompt) -> tuple[str | None, list[int], list]:
    """A vLLM-shaped prompt dict {"prompt": text | "prompt_token_ids": ids, "multi_modal_data":
    {"image": one or a list}} -> (text, ids with the image runs expanded, [(digest, pixels)]).
    `parse_prompt(p, name)` is the door's text / ids parser."""
    known = {"prompt", "prompt_token_ids", "multi_modal_data"}
    unknown = sorted(set(prompt) - known)
    if unknown:
        raise RequestError("prompt", f"unknown key(s) {unknown}; valid: {sorted(known)}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise RequestError("prompt", "give exactly one of 'prompt' (text) and "
                                     "'prompt_token_ids'")
    mm = prompt.get("multi_modal_data") or {}
    if not isinstance(mm, dict):
        raise RequestError("multi_modal_data", f"must be a dict like {{'image': ...}}, got "
                                               f"{type(mm).__name__}")
    if set(mm) - {"image"}:
        raise RequestError("multi_modal_data", f"unsupported modality {sorted(set(mm) - {'image'})}"
                                               "; only 'image'")
    text = prompt.get("prompt")
    if "image" not in mm:
        return parse_prompt(text if text is not None else prompt["prompt_token_ids"], "prompt"
                            if text is not None else "prompt_token_ids") + ([],)
    if spec is None:
        raise RequestError("multi_modal_data.image", "this model takes no images (it is text "
                                                     "only)")
    images = decode_images(mm["image"], spec, max_pixels)
    if text is not None:
        if not isinstance(text, str):
            raise RequestError("prompt", f"must be a string, got {type(text).__name__}")
        _, ids = parse_prompt(mark_text(text, spec), "prompt")
    else:
        text, ids = parse_prompt(prompt["prompt_token_ids"], "prompt_token_ids")
    ids, _ = expand(ids, images, spec)
    return text, ids, images
