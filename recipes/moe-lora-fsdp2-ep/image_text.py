"""Image + text rows for vision-language models (Qwen-VL family): messages with image parts -> token ids with
assistant-only labels (an image placeholder repeated once per merged patch) and the image processor's patches::

    tokenizer, image_processor = load_vl_processors(model_path, max_pixels=512 * 512)
    train_items, eval_items = load_vl_items(cfg.data, seed=42)          # (source, row, no_loss) items
    dataset = VLDataset(train_items, tokenizer=tokenizer, image_processor=image_processor,
                        image_token_id=hf_config.image_token_id, max_length=2048)

Rows are read when indexed; `check_vl_items` reads every local row once before training."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cookbook.sft.data import hold_out, pad_batch
from cookbook.sft.rows import IGNORE_INDEX, REASONING_KEYS, ROLES, SFTDataError, load_rows, row_label
from cookbook.sft.template import tokenize_conversation


@dataclass
class VLDataConfig:
    """The data section of an image + text recipe (`load_vl_items`, `VLDataset`, `load_vl_processors`)."""

    train_files: list[str] = field(
        default_factory=list
    )  # JSON / JSONL of {"images": [path, ...], "messages": [...]}; empty: hub_id
    eval_files: list[str] = field(default_factory=list)
    hub_id: str = "HuggingFaceH4/llava-instruct-mix-vsft"
    eval_fraction: float = 0.01
    max_length: int = 2048  # tokens per row, image tokens included
    packing: bool = False  # image + text rows are right-padded (3-D positions per row): true is refused
    num_workers: int = 4  # image decoding and resizing run in the loader's workers
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    image_min_pixels: int | None = None  # resize bounds (pixels per image; None: the image processor's own),
    image_max_pixels: int | None = None  # i.e. the number of image tokens


def is_vision_language(hf_config) -> bool:
    """True for a model config with a vision tower (``vision_config``: ``qwen3_vl_moe``, ``qwen2_5_vl``...)."""
    return getattr(hf_config, "vision_config", None) is not None


@dataclass
class _VLSource:
    """The rows of one data file or hub data set of image + text pairs; image paths are relative to ``base_dir``."""

    name: str
    rows: Any  # list[dict] (a JSON / JSONL file) or a datasets.Dataset (rows and their images read on access)
    base_dir: Path | None = None


def to_vl_messages(row: dict, where: str) -> tuple[list[dict], list[Any]]:
    """One image + text row as ``(messages, images)``, images in the order of their parts (user turns hold lists
    of parts, others strings). Rows: ``{"images": [...], "messages": [...]}`` with ``{"type": "image"}`` and
    ``{"type": "text", "text"}`` parts (TRL's layout), or ``{"image": ..., "messages": [...]}``; an image is a path
    relative to the data file or a PIL image. Images without image parts go before the first user turn's text.
    Raises SFTDataError: ``"<where>: ..."``: no image; images and image parts differ in number; an image part outside a
    user turn; an unknown role or part; no or an empty assistant turn."""
    images = row.get("images", row.get("image"))
    images = images if isinstance(images, list) else [] if images is None else [images]
    if not images or any(im is None for im in images):
        raise SFTDataError(
            f"{where}: no image ('images': [...] or 'image' missing, empty or null); this data path "
            f"trains on image + text pairs"
        )
    turns = row.get("messages")
    if not isinstance(turns, list) or not turns:
        raise SFTDataError(f"{where}: field 'messages' must be a non-empty list of turns")
    messages, n_parts = [], 0
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or "content" not in turn:
            raise SFTDataError(
                f"{where}: messages[{i}] must be an object with 'role' (one of {', '.join(ROLES)}) and 'content'"
            )
        held = [k for k in REASONING_KEYS if turn.get(k)]
        if held:  # never dropped in silence
            raise SFTDataError(
                f"{where}: messages[{i}].{held[0]} is set, but image + text rows train no reasoning: "
                f"remove it from the rows, or train on text rows (data.reasoning in the text recipes)"
            )
        content = turn["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise SFTDataError(f"{where}: messages[{i}].content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image" and turn["role"] == "user":
                parts.append({"type": "image"})
                n_parts += 1
            elif kind == "text" and isinstance(part.get("text", part.get("value")), str):  # "value": another layout
                parts.append({"type": "text", "text": part.get("text", part.get("value"))})
            else:
                raise SFTDataError(
                    f"{where}: messages[{i}].content[{j}] must be {{'type': 'text', 'text': str}} or, in "
                    f"a user turn, {{'type': 'image'}}; got {part!r:.80}"
                )
        if turn["role"] == "user":
            messages.append({"role": "user", "content": parts})
        else:
            messages.append({"role": turn["role"], "content": "".join(p["text"] for p in parts)})
            if turn["role"] == "assistant" and not messages[-1]["content"].strip():
                raise SFTDataError(f"{where}: messages[{i}] is an empty assistant turn")
    if n_parts == 0:
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None:
            raise SFTDataError(f"{where}: no user turn to hold the image")
        first_user["content"] = [{"type": "image"}] * len(images) + first_user["content"]
    elif n_parts != len(images):
        raise SFTDataError(f"{where}: {len(images)} image(s) but {n_parts} {{'type': 'image'}} part(s) in the messages")
    if messages[0]["role"] == "assistant" or not any(m["role"] == "assistant" for m in messages):
        raise SFTDataError(f"{where}: a conversation must start with a system or user turn and hold an assistant turn")
    return messages, images


def _open_image(ref: Any, base_dir: Path | None, where: str):
    """Decode one image (a path, relative to `base_dir` unless absolute, or a PIL image) to RGB.
    Raises SFTDataError: ``"<where>: ..."`` naming the file: not found or not decodable; neither a path nor an image."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    if not isinstance(ref, str):
        raise SFTDataError(f"{where}: an image must be a file path or a PIL image, got {type(ref).__name__}")
    path = Path(ref) if base_dir is None or Path(ref).is_absolute() else base_dir / ref
    if not path.is_file():
        raise SFTDataError(f"{where}: image file not found: {path}")
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:  # UnidentifiedImageError is an OSError
        raise SFTDataError(f"{where}: cannot decode image {path}: {exc}") from None


def vl_example(
    row: dict,
    where: str,
    base_dir: Path | None,
    tokenizer,
    image_processor,
    image_token_id: int,
    max_length: int,
    template_kwargs: dict | None = None,
    no_loss: bool = False,
) -> dict[str, Any]:
    """One image + text row as model inputs: ``input_ids`` and ``labels`` (L <= max_length; ``no_loss``: all
    -100), ``pixel_values`` (P, C * T * p * p) for the P patches of all images and ``image_grid_thw`` (n_images, 3).
    Raises SFTDataError: ``"<where>: ..."``: see `to_vl_messages`, `_open_image`; another number of image placeholders
    in the template's output; the image tokens do not fit in max_length."""
    messages, refs = to_vl_messages(row, where)
    images = [_open_image(ref, base_dir, where) for ref in refs]
    try:
        ids, labels, _ = tokenize_conversation(tokenizer, messages, 1 << 30, template_kwargs)
    except SFTDataError as exc:
        raise SFTDataError(f"{where}: {exc}") from None
    if ids.count(image_token_id) != len(images):
        raise SFTDataError(
            f"{where}: the chat template wrote {ids.count(image_token_id)} image placeholder tokens "
            f"(id {image_token_id}) for {len(images)} image(s): use the model's own chat template"
        )
    pixels = image_processor(images=images, return_tensors="pt")
    counts = iter((pixels["image_grid_thw"].prod(-1) // image_processor.merge_size**2).tolist())
    out_ids, out_labels = [], []
    for token, label in zip(ids, labels):
        n = next(counts) if token == image_token_id else 1
        out_ids += [token] * n
        out_labels += [label if n == 1 and token != image_token_id else IGNORE_INDEX] * n
    if len(out_ids) > max_length:
        last = len(out_ids) - out_ids[::-1].index(image_token_id)
        if last > max_length:
            raise SFTDataError(
                f"{where}: its image tokens reach token {last}, beyond data.max_length={max_length}: "
                f"raise data.max_length or lower data.image_max_pixels"
            )
        out_ids, out_labels = out_ids[:max_length], out_labels[:max_length]
    if no_loss:
        out_labels = [IGNORE_INDEX] * len(out_ids)
    return {
        "input_ids": out_ids,
        "labels": out_labels,
        "pixel_values": pixels["pixel_values"],
        "image_grid_thw": pixels["image_grid_thw"],
    }


class VLDataset(torch.utils.data.Dataset):
    """Image + text rows, tokenized and decoded when read; `items` are ``(source, row index, no_loss)``
    (``no_loss`` rows pad eval shards); `kwargs` are `vl_example`'s after ``base_dir``."""

    def __init__(self, items: list[tuple[_VLSource, int, bool]], **kwargs):
        self.items, self.kwargs = items, kwargs

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        source, n, no_loss = self.items[i]
        where = f"{source.name} {row_label(n + 1, getattr(source.rows, 'lines', None))}"
        return vl_example(dict(source.rows[n]), where, source.base_dir, no_loss=no_loss, **self.kwargs)


def load_vl_items(cfg: Any, seed: int) -> tuple[list[tuple], list[tuple]]:
    """Train and eval items ``(source, row index, no_loss)`` of `cfg`'s ``train_files`` (or the ``hub_id`` data set)
    and ``eval_files``; without eval files a ``eval_fraction`` of each source, seeded by `seed`, is held out.
    Raises SFTDataError: see `cookbook.sft.load_rows` (rows themselves are checked when read)."""
    if cfg.train_files:
        sources = [_VLSource(f, load_rows(f, "data.train_files"), Path(f).parent) for f in cfg.train_files]
    else:
        import datasets

        sources = [_VLSource(cfg.hub_id, datasets.load_dataset(cfg.hub_id, split="train"))]
    train, evals = [], []
    for source in sources:
        order, held = (
            hold_out(len(source.rows), cfg.eval_fraction, seed)
            if not cfg.eval_files and cfg.eval_fraction > 0
            else (range(len(source.rows)), [])
        )
        evals += [(source, i, False) for i in held]
        train += [(source, i, False) for i in order]
    for f in cfg.eval_files:
        source = _VLSource(f, load_rows(f, "data.eval_files"), Path(f).parent)
        evals += [(source, i, False) for i in range(len(source.rows))]
    return train, evals


def shard_items_for_eval(items: list[tuple], rank: int, world_size: int) -> list[tuple]:
    """This rank's evaluation items, padded with label-free copies so that every rank runs as many forwards
    (see `cookbook.sft.shard_for_eval`)."""
    if not items:
        return []
    mine = items[rank::world_size]
    return mine + [(*items[0][:2], True)] * (-(-len(items) // world_size) - len(mine))


def check_vl_items(dataset: VLDataset, hub_rows: int = 16) -> tuple[int, int]:
    """Read every local item of `dataset` (tokenized, images decoded) and the first `hub_rows` hub items before
    training; returns ``(rows checked, images decoded)``; raises the first bad row's `SFTDataError`."""
    local = [i for i, item in enumerate(dataset.items) if item[0].base_dir is not None]
    hub = [i for i, item in enumerate(dataset.items) if item[0].base_dir is None][:hub_rows]
    n_images = sum(len(dataset[i]["image_grid_thw"]) for i in local + hub)
    return len(local) + len(hub), n_images


def collate_vl(rows: list[dict], pad_id: int, image_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` / ``labels`` / ``attention_mask`` (B, L), ``mm_token_type_ids`` (B, L; 1 on
    image tokens, which the model needs for its 3-D M-RoPE positions), and the patches of all images of the
    batch concatenated: ``pixel_values`` (P, C * T * p * p), ``image_grid_thw`` (n_images, 3)."""
    batch = pad_batch(rows, pad_id, pad_to_multiple_of=8)
    batch["mm_token_type_ids"] = (batch["input_ids"] == image_token_id).long()
    batch["pixel_values"] = torch.cat([r["pixel_values"] for r in rows])
    batch["image_grid_thw"] = torch.cat([r["image_grid_thw"] for r in rows])
    return batch


def load_vl_processors(name_or_path: str, min_pixels: int | None = None, max_pixels: int | None = None):
    """``(tokenizer, image_processor)`` of a vision-language model (folder or hub id); the tokenizer carries the
    chat template (from the processor when only it has one); `min_pixels` / `max_pixels` bound each image's size.
    Raises OSError: no tokenizer or image processor files (transformers' error)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    image_processor = AutoImageProcessor.from_pretrained(name_or_path)
    if min_pixels or max_pixels:
        size = {
            "shortest_edge": min_pixels or image_processor.size["shortest_edge"],
            "longest_edge": max_pixels or image_processor.size["longest_edge"],
        }
        image_processor = AutoImageProcessor.from_pretrained(name_or_path, size=size)
    if tokenizer.chat_template is None:  # some VL repositories keep the template with the processor only
        tokenizer.chat_template = AutoProcessor.from_pretrained(name_or_path).chat_template
    return tokenizer, image_processor


def show_vl(
    cfg: Any, tokenizer, image_processor, image_token_id: int, n: int, template_kwargs: dict | None = None
) -> str:
    """`cookbook.sft.show_examples` for image + text rows: each train file's rows as `vl_example` renders them
    (image placeholders written ``<tok> x N``), the first `n` shown, all counted (rows cut at ``max_length``).
    Every row of a local file is read and its images decoded, as ``--check`` does; of a hub data set, `n` rows."""
    from cookbook.sft.stats import SFTStats
    from cookbook.sft.data import show_examples

    train, _ = load_vl_items(cfg, 0)
    sources = list({id(item[0]): item[0] for item in train}.values())
    parts = []
    for source in sources:
        rows = range(len(source.rows)) if source.base_dir is not None else range(min(n, len(source.rows)))
        st, examples = (
            SFTStats(
                source=source.name, max_length=cfg.max_length, rows=len(rows), lines=getattr(source.rows, "lines", None)
            ),
            [],
        )
        for i in rows:
            ex = vl_example(
                dict(source.rows[i]),
                f"{source.name} {st.label(i + 1)}",
                source.base_dir,
                tokenizer,
                image_processor,
                image_token_id,
                1 << 30,
                template_kwargs,
            )
            example = st.add(i + 1, ex["input_ids"], ex["labels"])
            if example is not None:
                examples.append(example)
        parts.append((examples, st))
    return show_examples(parts, tokenizer, n)
