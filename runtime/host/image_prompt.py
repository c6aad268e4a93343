"""Images in a prompt: where their tokens go and what the scheduler must know of them. No JAX.

A vision model's prompt marks each image where it goes (`ImageSpec.mark`: Gemma 3's
`<start_of_image>`, Qwen3-VL's `<|image_pad|>` between `<|vision_start|>` and `<|vision_end|>`;
the models' chat templates write them for an image part). The door expands every mark into the
image's token run (`expand`):

    Gemma 3     ... "\\n\\n" <boi> <image> x 256 <eoi> "\\n\\n" ...   (`around` text, the mark kept)
    Qwen3-VL    ... <|vision_start|> <|image_pad|> x N <|vision_end|> ...   (N from the image's size)

The image tokens' inputs are the vision encoder's output for the image, not the embedding
table's rows. A text prompt gets the `around` text at each mark (`mark_text`) and is tokenized;
a prompt of ids gets the run at each mark id (runs already expanded are kept as they are). The
number of marks must equal the number of images.

`decode_images` turns each image into the encoder's input by the model's kind (`PREPROCESS`:
Gemma 3 a fixed-size normalized picture; Qwen3-VL patches of a grid that follows the image's
size): an `ImageInput` (content digest, pixels, token count, grid). `ImageSpan`: one image's
token run in a prompt: its first image token's position, its length, digest, pixels and grid;
the prefix cache and the encoder cache key on the digest. The scheduler never splits a span
between two prefill chunks (Gemma 3's image tokens attend to each other both ways).

Qwen3-VL's multimodal RoPE (`mrope_positions`): text tokens count on from the last position on
all three axes; an image's tokens get (t0, t0 + row, t0 + column) over its merged grid, and the
text after it starts max(rows, columns) later; a request's generated tokens take position +
delta (delta = its last prompt position + 1 - its length).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxinfer.runtime.host.errors import RequestError


@dataclass(frozen=True)
class ImageSpec:
    """What the door needs of a vision model: how images are marked, expanded and preprocessed."""

    kind: str  # a PREPROCESS row: "gemma3" | "qwen3_vl"
    mark: str  # the text a prompt marks an image with
    mark_id: int  # the id the mark encodes to
    image_id: int  # an image token's id
    after: tuple[int, ...] = ()  # ids closing an image run (Gemma 3: <eoi>)
    around: str = ""  # text the processor writes on both sides of a mark (Gemma 3: blank lines)
    prep: tuple = ()  # the preprocessing's settings, ((name, value), ...)
    mrope_merge: int = 0  # Qwen3-VL: patches merged per side into a token (0: 1-D positions)
    bidirectional: bool = False  # an image's tokens attend to each other both ways (Gemma 3)

    def setting(self, name: str, default=None):
        return dict(self.prep).get(name, default)


@dataclass(frozen=True)
class ImageDoor:
    """What a front end needs to take images for the served model (Engine.image_door())."""

    spec: ImageSpec
    max_pixels: int  # EngineConfig.max_image_pixels
    limit: int  # EngineConfig.limit_mm_per_prompt


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image, decoded and preprocessed at the door."""

    key: bytes  # content digest
    pixels: np.ndarray = field(repr=False)  # the encoder's input
    tokens: int  # image tokens it takes in the prompt
    grid: tuple[int, int, int] | None = None  # (t, h, w) patches (Qwen3-VL)


@dataclass(frozen=True, eq=False)
class ImageSpan:
    start: int  # position of its first image token
    length: int  # image tokens
    key: bytes  # content digest
    pixels: np.ndarray = field(repr=False)  # the encoder's input
    grid: tuple[int, int, int] | None = None
    bidirectional: bool = False  # its tokens see the whole image (ImageSpec.bidirectional)

    @property
    def end(self) -> int:
        return self.start + self.length


def _gemma3(img, spec: ImageSpec) -> ImageInput:
    from jaxinfer.runtime.host.images import image_digest, pixel_values

    px = pixel_values(img, spec.setting("size"), spec.setting("mean"), spec.setting("std"))
    return ImageInput(image_digest(img), px, spec.setting("tokens"))


def _qwen3_vl(img, spec: ImageSpec) -> ImageInput:
    from jaxinfer.runtime.host.images import image_digest
    from jaxinfer.runtime.host.qwen_images import qwen_patches

    patches, grid = qwen_patches(img, **dict(spec.prep))
    t, h, w = grid
    return ImageInput(image_digest(img), patches, t * h * w // spec.mrope_merge ** 2,
                      tuple(int(x) for x in grid))


PREPROCESS = {"gemma3": _gemma3, "qwen3_vl": _qwen3_vl}  # kind -> (PIL image, spec) -> input


def mark_text(text: str, spec: ImageSpec) -> str:
    """A text prompt with what the model's processor writes around each image mark (tokenized
    with the rest; the mark itself encodes to spec.mark_id)."""
    if not spec.around:
        return text
    return text.replace(spec.mark, f"{spec.around}{spec.mark}{spec.around}")


def expand(ids: Sequence[int], images: Sequence[ImageInput], spec: ImageSpec,
           name: str = "prompt") -> tuple[list[int], tuple[ImageSpan, ...]]:
    """ids with each image mark expanded to the image's token run, and the spans; `images` in
    prompt order. A run expanded already is kept (it must hold exactly the image's tokens)."""
    out: list[int] = []
    spans: list[ImageSpan] = []
    i, own = 0, spec.mark_id == spec.image_id  # (Qwen3-VL: the mark is an image token)
    while i < len(ids):
        t = ids[i]
        i += 1
        if t != spec.mark_id:
            if t == spec.image_id:
                raise RequestError(name, f"image token {t} outside an image run")
            out.append(t)
            continue
        if len(spans) == len(images):
            raise RequestError(name, f"has more image marks ({spec.mark!r}) than the "
                                     f"{len(images)} image(s) given")
        im = images[len(spans)]
        n = im.tokens
        run = 1 if own else 0
        while i < len(ids) and ids[i] == spec.image_id:
            run, i = run + 1, i + 1
        if run not in ((1, n) if own else (0, n)):
            raise RequestError(name, f"an image run must hold exactly {n} image tokens "
                                     f"(image {len(spans)}), got {run}")
        if not own:
            out.append(t)
            if run:  # expanded already: its closing ids follow
                if list(ids[i:i + len(spec.after)]) != list(spec.after):
                    raise RequestError(name, f"an image run must end with {list(spec.after)}")
                i += len(spec.after)
        spans.append(ImageSpan(len(out), n, im.key, im.pixels, im.grid, spec.bidirectional))
        out += [spec.image_id] * n + list(spec.after)
    if len(spans) != len(images):
        raise RequestError("multi_modal_data.image" if name == "prompt" else name,
                           f"{len(images)} image(s) given but the prompt marks {len(spans)} "
                           f"(write {spec.mark!r} where each goes, or use the chat API)")
    return out, tuple(spans)


def mrope_positions(n: int, spans: Sequence[ImageSpan], merge: int
                    ) -> tuple[np.ndarray, int]:
    """A prompt of n tokens with image `spans` -> (int32 [n, 3] (t, h, w) RoPE positions, the
    delta generated tokens add to their position)."""
    pos = np.zeros((n, 3), np.int32)
    cur = i = 0
    for s in sorted(spans, key=lambda s: s.start):
        k = s.start - i  # text before the image
        pos[i:s.start] = (cur + np.arange(k))[:, None]
        cur += k
        t, h, w = s.grid[0], s.grid[1] // merge, s.grid[2] // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        pos[s.start:s.end] = cur + np.stack([tt, hh, ww], -1).reshape(-1, 3)
        cur += max(h, w)
        i = s.end
    pos[i:] = (cur + np.arange(n - i))[:, None]
    return pos, int(pos.max()) + 1 - n


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
                  ) -> list[ImageInput]:
    """An image or a list of them (PIL images, numpy arrays, bytes, data URLs / base64) -> the
    encoder's inputs, each checked at runtime/host/images.py's door."""
    from jaxinfer.runtime.host.images import load_image

    items = list(value) if isinstance(value, (list, tuple)) else [value]
    out = []
    for i, v in enumerate(items):
        field_name = f"{name}[{i}]" if isinstance(value, (list, tuple)) else name
        out.append(PREPROCESS[spec.kind](load_image(v, field_name, max_pixels=max_pixels), spec))
    return out


def parse_multimodal(prompt: dict, tokenizer, door: ImageDoor | None,
                     parse_prompt) -> tuple[str | None, list[int], list]:
    """A vLLM-shaped prompt dict {"prompt": text | "prompt_token_ids": ids, "multi_modal_data":
    {"image": one or a list}} -> (text, ids with the image runs expanded, [ImageInput]).
    `door`: the served model's (None: text only); `parse_prompt(p, name)` is the request
    door's text / ids parser."""
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
    if door is None:
        raise RequestError("multi_modal_data.image", "this model takes no images (it is text "
                                                     "only)")
    spec = door.spec
    images = decode_images(mm["image"], spec, door.max_pixels)
    if text is not None:
        if not isinstance(text, str):
            raise RequestError("prompt", f"must be a string, got {type(text).__name__}")
        _, ids = parse_prompt(mark_text(text, spec), "prompt")
    else:
        text, ids = parse_prompt(prompt["prompt_token_ids"], "prompt_token_ids")
    ids, _ = expand(ids, images, spec)
    return text, ids, images
