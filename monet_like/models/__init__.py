"""Model expressions from the command line, parsed (never eval'd) and built.

Accepted forms:
  torchvision.models.NAME(...)   any constructor in torchvision.models, literal arguments
  unet, unet(...)                the UNet defined in this package
  gpt, gpt(...)                  the small GPT-style transformer defined in this package
  timm.NAME(...)                 timm.create_model("NAME", ...), random weights
  transformers.ARCH(...)         a transformers model from its config fields (gpt2, bert,
                                 llama, t5, vit...), returning its logits
  package.module:factory(...)    a user's own factory, imported by module path
Arguments must be Python literals (numbers, strings, booleans, None, tuples...).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from monet_like.errors import UserError
from monet_like.inputs import input_dtype, make_input  # noqa: F401  (re-exported: models make inputs)

# Default per-sample input shapes (no batch dimension) for the known families.
_IMAGE_SHAPE = (3, 224, 224)
_DEFAULT_SHAPES = {"inception_v3": (3, 299, 299), "unet": (3, 416, 608), "gpt": (256,)}


def _in_repo_models() -> dict[str, Callable[..., nn.Module]]:
    from monet_like.models.gpt import GPT
    from monet_like.models.unet import UNet

    return {"unet": UNet, "gpt": GPT}


def classification_models() -> list[str]:
    """Names of every classification constructor in torchvision.models."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


@contextlib.contextmanager
def _parameters_on_meta():
    """Within: every parameter and buffer registered on a module moves to "meta"."""
    saved = nn.Module.register_parameter, nn.Module.register_buffer
    register_parameter, register_buffer = saved

    def parameter(self, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register_parameter(self, name, param)

    def buffer(self, name, tensor, persistent=True):
        if tensor is not None and not tensor.is_meta:
            tensor = tensor.to("meta")
        register_buffer(self, name, tensor, persistent)

    nn.Module.register_parameter, nn.Module.register_buffer = parameter, buffer
    try:
        yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = saved


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model expression: what to call and with which literal arguments."""

    expression: str
    family: str  # "torchvision", "timm", "transformers", "repo" or "factory"
    target: str  # constructor name, in-repo model name, or "module:factory"
    args: tuple = ()
    kwargs: tuple = field(default_factory=tuple)  # sorted (name, value) pairs

    @property
    def name(self) -> str:
        """A short name fit for file names: 'resnet50', 'unet', 'mypkg.nets_tiny'."""
        base = self.target.replace(":", "_")
        if self.family == "torchvision":
            return base.rsplit(".", 1)[-1]
        if self.family in ("timm", "transformers"):
            return f"{self.family}_{base}"
        return base

    def constructor(self) -> Callable[..., nn.Module]:
        if self.family == "repo":
            return _in_repo_models()[self.target]
        if self.family == "timm":
            from monet_like.models.thirdparty import timm_constructor

            return timm_constructor(self.target)
        if self.family == "transformers":
            from monet_like.models.thirdparty import hf_constructor

            return hf_constructor(self.target)
        if self.family == "torchvision":
            import torchvision.models as tvm

            obj: Any = tvm
            for part in self.target.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    raise UserError(f"torchvision.models has no model named {self.target!r}")
            if not callable(obj):
                raise UserError(f"torchvision.models.{self.target} is not a model constructor")
            return obj
        module_name, _, attr = self.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UserError(f"cannot import module {module_name!r}: {exc}") from None
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise UserError(f"module {module_name!r} has no callable named {attr!r}")
        return factory

    def build(self, device: str | torch.device = "cpu") -> nn.Module:
        """Construct the model with random initialisation (no weights are downloaded).

        device="meta" builds it without allocating, for capture of large models.
        """
        ctor = self.constructor()
        try:
            try:
                with torch.device(device):
                    model = ctor(*self.args, **dict(self.kwargs))
            except (RuntimeError, NotImplementedError):
                if torch.device(device).type != "meta":
                    raise
                # Some constructors read tensor values while building (RegNet): build
                # on the CPU and move each parameter to "meta" as it is registered.
                with _parameters_on_meta():
                    model = ctor(*self.args, **dict(self.kwargs))
        except UserError:
            raise
        except Exception as exc:  # a bad keyword, a bad value: the user's input
            raise UserError(f"{self.expression}: construction failed: {exc}") from None
        if not isinstance(model, nn.Module):
            raise UserError(f"{self.expression} did not return a torch.nn.Module")
        return model

    def default_input_shape(self) -> tuple[int, ...] | None:
        if self.family == "factory":
            return None
        if self.family in ("timm", "transformers"):
            from monet_like.models.thirdparty import default_input_shape

            return default_input_shape(self.family, self.target, dict(self.kwargs))
        return _DEFAULT_SHAPES.get(self.target.rsplit(".", 1)[-1], _IMAGE_SHAPE)


def _literal(node: ast.AST, expression: str) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise UserError(
            f"malformed model expression {expression!r}: arguments must be literals, "
            f"got {ast.unparse(node)!r}"
        ) from None


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def parse_model(expression: str) -> ModelSpec:
    """Parse a model expression; raise UserError with a one-line reason if it is not one."""
    text = expression.strip()
    if not text:
        raise UserError("empty model expression")
    factory_module = None
    if ":" in text.split("(", 1)[0]:
        factory_module, _, text_after = text.partition(":")
        factory_module = factory_module.strip()
        text = text_after.strip()
        if not factory_module or not all(p.isidentifier() for p in factory_module.split(".")):
            raise UserError(f"malformed model expression {expression!r}: bad module path")
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        raise UserError(f"malformed model expression {expression!r}") from None
    args: tuple = ()
    kwargs: tuple = ()
    if isinstance(tree, ast.Call):
        if any(isinstance(a, ast.Starred) for a in tree.args) or any(
            k.arg is None for k in tree.keywords
        ):
            raise UserError(f"malformed model expression {expression!r}: no * or ** arguments")
        args = tuple(_literal(a, expression) for a in tree.args)
        kwargs = tuple(sorted((k.arg, _literal(k.value, expression)) for k in tree.keywords))
        tree = tree.func
    path = _dotted(tree)
    if path is None:
        raise UserError(f"malformed model expression {expression!r}")

    if factory_module is not None:
        if "." in path:
            raise UserError(f"malformed model expression {expression!r}: factory must be a name")
        spec = ModelSpec(expression, "factory", f"{factory_module}:{path}", args, kwargs)
    elif path in _in_repo_models():
        spec = ModelSpec(expression, "repo", path, args, kwargs)
    elif path.startswith(("timm.", "transformers.")) and path.count(".") == 1:
        family, _, name = path.partition(".")
        spec = ModelSpec(expression, family, name, args, kwargs)
    elif path.startswith("torchvision.models."):
        spec = ModelSpec(
            expression, "torchvision", path[len("torchvision.models.") :], args, kwargs
        )
    else:
        raise UserError(
            f"unknown model {path!r}: use torchvision.models.NAME(...), timm.NAME(...), "
            "transformers.ARCH(...), unet, gpt, or package.module:factory"
        )
    _refuse_downloads(spec)
    spec.constructor()  # fail now, with a clear message, if it does not resolve
    return spec


# Keywords with which torchvision and timm constructors fetch pretrained weights.
_WEIGHT_KEYWORDS = ("weights", "weights_backbone", "pretrained", "pretrained_backbone")


def _refuse_downloads(spec: ModelSpec) -> None:
    """monet_like builds models with random weights and never downloads: a keyword that
    would fetch weights is refused before anything runs."""
    if spec.family not in ("torchvision", "timm"):
        return
    for name, value in spec.kwargs:
        if name in _WEIGHT_KEYWORDS and value not in (None, False):
            raise UserError(
                f"{spec.expression}: {name}={value!r} would download pretrained weights, which"
                f" monet_like never does; build it with {name}="
                f"{'None' if name.startswith('weights') else 'False'} (a schedule does not"
                " depend on the weights' values) and load your checkpoint into the model"
            )


def parse_input_shape(text: str) -> tuple[int, ...]:
    """'3,224,224' -> (3, 224, 224); per-sample shape, without the batch dimension."""
    try:
        shape = tuple(int(p) for p in text.replace("x", ",").split(",") if p.strip())
    except ValueError:
        raise UserError(
            f"malformed input shape {text!r}: expected integers like 3,224,224"
        ) from None
    if not shape or any(d <= 0 for d in shape):
        raise UserError(f"malformed input shape {text!r}: dimensions must be positive")
    return shape
