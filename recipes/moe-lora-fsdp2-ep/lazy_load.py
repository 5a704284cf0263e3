"""Shard-by-shard loading of safetensors weights into a model built on the meta device, each rank reading only
what it keeps (``safe_open(...).get_slice``)::

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(hf_config)
    model = get_peft_model(model, lora_config)          # optional: adapter factors are not read
    load_base_lazily(model, "Qwen/Qwen3-30B-A3B")     # a folder or a hub id (cookbook.hub.model_folder)

A module that keeps a slice of a tensor's first axis (of the experts) sets ``checkpoint_offset``."""

from __future__ import annotations

import contextlib
import re

import torch

from cookbook.config import ConfigError
from cookbook.hub import model_folder

# Checkpoint key prefixes that transformers renames at load time (its conversion_mapping.py): saved -> model.
_RENAMES = {"nemotron_h": [("backbone.", "model.")]}
_PER_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
_WRAPPER = re.compile(r"\.base_layer\b")  # PEFT's wrapper attribute: not in checkpoint names


@torch.no_grad()
def load_base_lazily(model: torch.nn.Module, name_or_path: str, key: str = "model.lazy_load") -> int:
    """Fill the parameters of `model` still on the meta device (and persistent buffers) from the safetensors
    checkpoint of `name_or_path`, reading only what this rank keeps; returns the tensor elements read.

    Layouts (those transformers 5 converts for its MoE models): tensors under the parameter's name (PEFT's
    ``base_layer`` left out); fused 3-D ``...experts.<name>`` (E, a, b) or transposed (E, b, a); per-expert
    ``...experts.<e>.<name>.weight`` stacked, ``gate_up_proj`` = ``gate_proj`` and ``up_proj`` rows concatenated;
    the prefix renames of `_RENAMES`. A module with ``checkpoint_offset`` o and n rows gets rows [o, o + n).
    Raises ConfigError: a parameter with no tensor in the checkpoint or one of another shape (says to set
    ``<key>=false``)."""
    from safetensors import safe_open

    hf = model.base_model.model if type(model).__module__.startswith("peft.") else model  # a PeftModel: its inner model
    renames = _RENAMES.get(getattr(getattr(hf, "config", None), "model_type", None), [])
    with contextlib.ExitStack() as stack:
        dense, per_expert = {}, {}
        for f in sorted(model_folder(name_or_path).glob("*.safetensors")):
            handle = stack.enter_context(safe_open(str(f), framework="pt"))
            for ckpt_key in handle.keys():
                name = ckpt_key
                for old, new in renames:
                    name = new + name[len(old) :] if name.startswith(old) else name
                m = _PER_EXPERT_KEY.match(name)
                if m:
                    per_expert[(m[1], m[3], int(m[2]))] = (handle, ckpt_key)
                else:
                    dense[name] = (handle, ckpt_key)

        def missing(target: str, why: str) -> ConfigError:
            return ConfigError(
                f"{key}: {why} for {target} in {name_or_path}; set {key}=false to load the checkpoint "
                f"with transformers (every rank then holds the whole model in memory first)"
            )

        def read(target: str, module: torch.nn.Module, shape: torch.Size) -> torch.Tensor:
            first = getattr(module, "checkpoint_offset", 0)
            if target in dense and len(shape) == 3:
                handle, ckpt_key = dense[target]
                t = handle.get_slice(ckpt_key)[first : first + shape[0]]
                if t.shape[1:] != shape[1:] and t.shape[1:] == shape[1:][::-1]:
                    t = t.transpose(1, 2)
            elif target in dense:
                handle, ckpt_key = dense[target]
                t = handle.get_tensor(ckpt_key)
            elif len(shape) == 3 and "." in target:  # fused experts from per-expert tensors
                prefix, pname = target.rsplit(".", 1)
                parts = ("gate_proj", "up_proj") if pname == "gate_up_proj" else (pname,)
                keys = [[per_expert.get((prefix, part, e)) for part in parts] for e in range(first, first + shape[0])]
                if any(k is None for ks in keys for k in ks):
                    raise missing(
                        target,
                        f"no tensor {prefix}.<e>.{'/'.join(parts)}.weight for experts {first}..{first + shape[0] - 1}",
                    )
                t = torch.stack([torch.cat([h.get_tensor(k) for h, k in ks]) for ks in keys])
            else:
                raise missing(target, "no tensor")
            if t.shape != shape:
                raise missing(target, f"a tensor of shape {tuple(t.shape)} instead of {tuple(shape)}")
            return t

        names: dict[int, list[str]] = {}  # tied parameters: one object under several names
        for mod_name, module in hf.named_modules():
            for pname, p in module._parameters.items():
                if p is not None and p.is_meta:
                    names.setdefault(id(p), []).append(_WRAPPER.sub("", f"{mod_name}.{pname}".lstrip(".")))
        done: dict[int, torch.nn.Parameter] = {}
        elements = 0
        for mod_name, module in hf.named_modules():
            for pname, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in done:
                    aliases = names[id(p)]
                    t = read(next((a for a in aliases if a in dense), aliases[0]), module, p.shape)
                    elements += t.numel()
                    done[id(p)] = torch.nn.Parameter(t.to(p.dtype).contiguous(), requires_grad=p.requires_grad)
                setattr(module, pname, done[id(p)])
            for bname, b in module._buffers.items():
                target = _WRAPPER.sub("", f"{mod_name}.{bname}".lstrip("."))
                if b is not None and bname not in module._non_persistent_buffers_set and target in dense:
                    handle, ckpt_key = dense[target]
                    b.copy_(handle.get_tensor(ckpt_key))
    return elements
