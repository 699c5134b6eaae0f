"""Models from timm and Hugging Face transformers, built from code with random weights.

    timm.NAME(...)            timm.create_model("NAME", pretrained=False, ...)
    transformers.ARCH(...)    the ARCH model of transformers from its config class, the
                              keywords being config fields; wrapped so that it takes one
                              tensor and returns its logits

Nothing is downloaded: `pretrained` is refused, and transformers models are made from
a config object, never from a hub name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from monet_like.errors import UserError

# ARCH -> (config class, model class, input kind). "tokens": int64 ids (batch, length);
# "seq2seq": the same ids feed the encoder and, as decoder input, the decoder;
# "image": pixels (batch, channels, height, width).
HF_ARCHITECTURES: dict[str, tuple[str, str, str]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "tokens"),
    "bert": ("BertConfig", "BertForMaskedLM", "tokens"),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", "tokens"),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "tokens"),
    "mistral": ("MistralConfig", "MistralForCausalLM", "tokens"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "tokens"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", "tokens"),
    "t5": ("T5Config", "T5ForConditionalGeneration", "seq2seq"),
    "vit": ("ViTConfig", "ViTForImageClassification", "image"),
}


def _require(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"{module} is not installed: pip install {module} (install.sh installs it)"
        ) from None


def timm_constructor(name: str) -> Callable[..., nn.Module]:
    """A constructor of timm model `name` that never loads pretrained weights."""
    timm = _require("timm")
    if not timm.is_model(name):
        raise UserError(f"timm has no model named {name!r} (timm.list_models() lists them)")

    def build(*args, **kwargs) -> nn.Module:
        if args:
            raise UserError(f"timm.{name}(...) takes keyword arguments only")
        if kwargs.pop("pretrained", False):
            raise UserError(
                f"timm.{name}(pretrained=True) would download weights, which monet_like never"
                " does: build it with random weights and load a checkpoint yourself"
            )
        return timm.create_model(name, pretrained=False, **kwargs)

    return build


class LogitsOf(nn.Module):
    """A transformers model as a one-tensor-in, logits-out module.

    Attributes `input_dtype` and `vocab_size` tell monet_like what input to make."""

    def __init__(self, model: nn.Module, kind: str) -> None:
        super().__init__()
        self.model = model
        self.kind = kind
        if kind in ("tokens", "seq2seq"):
            self.input_dtype = torch.long
            self.vocab_size = int(model.config.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "seq2seq":
            return self.model(input_ids=x, decoder_input_ids=x, use_cache=False).logits
        if self.kind == "image":
            return self.model(pixel_values=x).logits
        return self.model(input_ids=x, use_cache=False).logits


def hf_constructor(arch: str) -> Callable[..., nn.Module]:
    """A constructor of transformers architecture `arch` from its config's fields."""
    if arch not in HF_ARCHITECTURES:
        raise UserError(
            f"transformers.{arch}: unknown architecture; known: {', '.join(HF_ARCHITECTURES)}"
        )
    transformers = _require("transformers")
    config_name, model_name, kind = HF_ARCHITECTURES[arch]

    def build(*args, **fields) -> nn.Module:
        if args:
            raise UserError(f"transformers.{arch}(...) takes config fields as keywords only")
        try:
            config = getattr(transformers, config_name)(**fields)
            model = getattr(transformers, model_name)(config)
        except (TypeError, ValueError) as exc:
            raise UserError(f"transformers.{arch}: {exc}") from None
        return LogitsOf(model, kind)

    return build


def default_input_shape(family: str, name: str, kwargs: dict) -> tuple[int, ...] | None:
    """Per-sample input shape for a third-party model: tokens of length 64, or images."""
    if family == "transformers":
        kind = HF_ARCHITECTURES.get(name, ("", "", "tokens"))[2]
        if kind == "image":
            size = int(kwargs.get("image_size", 224))
            return (int(kwargs.get("num_channels", 3)), size, size)
        return (64,)
    size = kwargs.get("img_size")
    if isinstance(size, int):
        return (int(kwargs.get("in_chans", 3)), size, size)
    return (int(kwargs.get("in_chans", 3)), 224, 224)
